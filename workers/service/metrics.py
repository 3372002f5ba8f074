"""``/metrics`` of one worker actor: the worker-side metrics of `workers.metrics`, read from its
backend when Prometheus scrapes (no polling thread).

    num_requests_running / waiting, kv_pages_used / capacity     every role (`WorkerLoad`)
    prompt_tokens_total, generation_tokens_total                  every role (`EngineStats`)
    spec_decode_num_draft / accepted_tokens_total                 decode / mixed (`EngineStats`)
    kv_pages_pinned_for_transfer, kv_messenger_queue_depth        decode / prefill (messenger)
    kv_transfer_seconds / bytes / exposed_seconds                 prefill (it pushes the KV)
    kv_transfer_failures_total                                    decode / prefill
    kv_checksum_failures_total                                    decode (checksum mode)
    kv_unauthenticated_messages_total                             decode / prefill (messenger)
    kv_transfer_pages_total{outcome="written"|"skipped"}          decode (messenger)

The token counters are this worker's engine's, not the requests' (the router counts those):
``prompt_tokens_total`` counts prompt tokens run through the model, so a prompt recomputed after
preemption counts again, and a request split across roles counts on both (a decoder computes its
last prompt token, the prefill worker the others); ``generation_tokens_total`` counts tokens
sampled, which a prefill worker never does (its series stays at 0). Each scrape adds what the
engine counted since the last one; if the engine's count went back (a new engine counts from 0
again), it adds the new count.

Transfer histograms observe each ended transfer once: the messenger keeps a bounded record of
recent ones (`finished_transfers`), and a scrape observes those it has not seen. Transfers that
ended and left that memory between two scrapes are not observed (bounded memory, not a log).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.metrics_core import Metric

from workers.metrics import LABEL_VALUES, Metrics, serve_metrics

logger = logging.getLogger(__name__)


# Words of the messenger's free-text failure reasons -> the closed `reason` vocabulary.
_REASON_WORDS: tuple[tuple[str, str], ...] = (
    ("deadline", "deadline"),
    ("timeout", "deadline"),
    ("reject", "rejected"),
    ("abort", "aborted"),
    ("cancel", "aborted"),
    ("drain", "aborted"),
    ("write", "fabric_error"),
    ("fabric", "fabric_error"),
)


def failure_label(reason: str) -> str:
    lowered = reason.lower()
    if lowered in LABEL_VALUES["reason"]:
        return lowered
    for word, label in _REASON_WORDS:
        if word in lowered:
            return label
    return "protocol_error"


class _RefreshingRegistry(CollectorRegistry):
    """A registry that brings its gauges up to date before every collection."""

    def __init__(self, refresh: Callable[[], None]) -> None:
        super().__init__()
        self._refresh = refresh

    def collect(self) -> Iterator[Metric]:
        try:
            self._refresh()
        except Exception:  # a scrape must still answer (with the last values)
            logger.exception("refreshing worker metrics failed")
        yield from super().collect()


class WorkerMetricsExporter:
    def __init__(self, backend: Any, role: str, model_dir: str) -> None:
        self.backend = backend
        self.registry = _RefreshingRegistry(self.refresh)
        self.metrics = Metrics(self.registry, role=role, model=Path(model_dir).name)
        self._seen: set[str] = set()
        # The engine's token counts at the last scrape, by counter.
        self._last_counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._server: Any = None
        self.port = 0

    def start(self, host: str, port: int) -> int:
        self._server, self.port = serve_metrics(self.registry, host, port)
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def refresh(self) -> None:
        with self._lock:  # scrapes may overlap (one thread each): count each token once
            self._refresh()

    def _refresh(self) -> None:
        metrics, load = self.metrics, self.backend.load()
        metrics.num_requests_running.set(load.num_running_requests)
        metrics.num_requests_waiting.set(load.num_waiting_requests)
        metrics.kv_pages_capacity.set(load.num_total_kv_pages)
        metrics.kv_pages_used.set(load.num_total_kv_pages - load.num_free_kv_pages)
        self._count_up(metrics.prompt_tokens, "prompt", load.num_computed_prompt_tokens)
        self._count_up(metrics.generation_tokens, "generation", load.num_sampled_tokens)
        self._count_up(metrics.prefix_cache_queries, "cache_queries", load.num_prefix_cache_queries)
        self._count_up(metrics.prefix_cache_hits, "cache_hits", load.num_prefix_cache_hits)
        self._count_up(metrics.spec_draft_tokens, "spec_drafts", load.num_spec_draft_tokens)
        self._count_up(metrics.spec_accepted_tokens, "spec_kept", load.num_spec_accepted_tokens)
        self._count_up(
            metrics.kv_unauthenticated_messages,
            "unauthenticated",
            load.num_unauthenticated_messages,
        )
        for outcome, total in (
            ("written", load.num_kv_pages_written),
            ("skipped", load.num_kv_pages_skipped),
        ):
            metrics.count_transfer_pages(outcome, self._growth(f"pages_{outcome}", total))
        for position, total in enumerate(load.num_spec_accepted_per_pos):
            metrics.count_accepted_at(position, self._growth(f"spec_kept_{position}", total))
        worker = getattr(self.backend, "worker", None)  # the KV roles' `workers.service.kv_worker`
        if worker is None:
            return
        state = worker.state()
        metrics.kv_pages_pinned_for_transfer.set(int(state.get("num_pinned_pages", 0)))
        by_state = state.get("transfers_by_state", {})
        for queue in LABEL_VALUES["queue"]:
            metrics.set_queue_depth(queue, int(by_state.get(queue, 0)))
        self._observe_transfers(worker.finished_transfers())

    def _count_up(self, counter: Counter, key: str, total: int) -> None:
        counter.inc(self._growth(key, total))

    def _growth(self, key: str, total: int) -> int:
        """What the engine's ``total`` grew since the last scrape, or all of it when it went
        back (it counts from 0 again): a counter never goes down."""
        last, self._last_counts[key] = self._last_counts.get(key, 0), total
        return total - last if total >= last else total

    def _observe_transfers(self, records: dict[str, dict[str, Any]]) -> None:
        self._seen &= records.keys()  # forget what left the worker's memory
        for request_id, record in records.items():
            if request_id in self._seen:
                continue
            self._seen.add(request_id)
            self._observe(record)

    def _observe(self, record: dict[str, Any]) -> None:
        metrics = self.metrics
        if record.get("state") == "failed":
            metrics.count_transfer_failure(failure_label(str(record.get("reason") or "")))
            if record.get("checksum_mismatch"):  # a decoder in checksum mode caught corrupt KV
                metrics.kv_checksum_failures.inc()
            return
        if "num_bytes" not in record:  # a decoder's record: the prefill side measures
            return
        metrics.kv_transfer_bytes.observe(record["num_bytes"])
        done, first = record.get("last_completion_s"), record.get("first_submit_s")
        if done is not None and first is not None:
            metrics.kv_transfer_seconds.observe(max(0.0, done - first))
        forward_end = record.get("forward_end_s")
        if done is not None and forward_end is not None:
            metrics.kv_transfer_exposed_seconds.observe(max(0.0, done - forward_end))
