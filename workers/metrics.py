"""Prometheus metrics of the router and every worker, and the ``/metrics`` endpoint.

Every metric is declared once in `METRIC_SPECS` (name, type, help, labels, buckets) and checked
against the golden list in ``workers/metrics_contract.json`` by ``tests/ops``; the Grafana
dashboards may only read names from that list. Names follow vLLM's vocabulary under the
``pdserve_`` prefix, in base units (seconds, bytes), counters ending in ``_total``.

Labels: every series carries ``role`` (router / prefill / decode / mixed) and ``model``, bound
once when a process builds its `Metrics`. The few extra labels take values from closed
vocabularies (`LABEL_VALUES`) or from bounded sets (``worker``: worker ids of one cluster),
never a request id, so the number of series stays fixed as traffic grows.

Metrics are created on a caller-supplied `CollectorRegistry` rather than the global one, so
that tests and several in-process workers do not collide.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import start_wsgi_server

__all__ = [
    "BASE_LABELS",
    "LABEL_VALUES",
    "METRIC_SPECS",
    "ROLES",
    "MetricSpec",
    "Metrics",
    "serve_metrics",
]

logger = logging.getLogger(__name__)

MetricKind = Literal["counter", "gauge", "histogram"]

ROLES: tuple[str, ...] = ("router", "prefill", "decode", "mixed")
BASE_LABELS: tuple[str, ...] = ("role", "model")

# Closed vocabularies of the extra labels. Their series are created up front at zero, so that
# rate() and dashboards see a flat line rather than "no data" before the first event.
LABEL_VALUES: Mapping[str, tuple[str, ...]] = {
    # `workers.engine.sequence.FinishReason` less "prefilled", which ends a prefill worker's
    # share of a request, not the request.
    "finished_reason": ("stop", "length", "abort"),
    # Why a KV transfer failed (the FAILED edges of `workers.kv.transfer_state`).
    "reason": ("deadline", "rejected", "aborted", "protocol_error", "fabric_error"),
    # Non-terminal transfer states: the messenger's queues on each side.
    "queue": ("allocated", "requested", "receiving", "queued", "prefilling", "writing", "draining"),
    # What the router changed when it sent a request again before its first token: the prefill
    # worker (its KV transfer failed) or the serving worker (its worker was lost or refused it).
    "kind": ("prefill", "worker"),
    # Draft positions of speculative decoding (0: the first draft after the newest token), up
    # to `workers.engine.speculative.MAX_SPECULATIVE_TOKENS`.
    "position": tuple(str(i) for i in range(16)),
    # A decoder's prompt KV pages: written by a prefill worker, or held in its prefix cache.
    "outcome": ("written", "skipped"),
}

# Buckets, vLLM-like: client-visible latencies span milliseconds (a short prompt on an idle
# cluster) to minutes (long generations under load).
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
# Decode steps are the point of disaggregation: resolve single milliseconds at the low end.
ITL_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
REQUEST_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
QUEUE_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
# A KV push costs tens to hundreds of ms on the reference deployment (docs/design.md §1).
TRANSFER_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
# Bytes of one request's KV: 4 KiB (a page of a tiny model) to 64 GiB (long prompts on big
# models), a factor of 4 apart.
BYTE_BUCKETS: tuple[float, ...] = tuple(float(4096 * 4**k) for k in range(13))


@dataclass(frozen=True)
class MetricSpec:
    """One metric as exposed: ``name`` is the exposition name (counters end in ``_total``);
    ``labels`` are those beyond `BASE_LABELS`."""

    name: str
    kind: MetricKind
    documentation: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None

    @property
    def label_names(self) -> tuple[str, ...]:
        return BASE_LABELS + self.labels


def _histogram(name: str, doc: str, buckets: tuple[float, ...]) -> MetricSpec:
    return MetricSpec(name, "histogram", doc, buckets=buckets)


METRIC_SPECS: tuple[MetricSpec, ...] = (
    # --- requests (router: what clients see; workers: their share) ---------------------------
    _histogram(
        "pdserve_time_to_first_token_seconds",
        "Time from request arrival to its first output token.",
        TTFT_BUCKETS,
    ),
    _histogram(
        "pdserve_inter_token_latency_seconds",
        "Time between two consecutive output tokens of one request.",
        ITL_BUCKETS,
    ),
    _histogram(
        "pdserve_e2e_request_latency_seconds",
        "Time from request arrival to its last output token.",
        REQUEST_BUCKETS,
    ),
    _histogram(
        "pdserve_request_queue_time_seconds",
        "Time a request waited before it was scheduled.",
        QUEUE_BUCKETS,
    ),
    MetricSpec("pdserve_num_requests_running", "gauge", "Requests being processed now."),
    MetricSpec("pdserve_num_requests_waiting", "gauge", "Requests waiting to be scheduled."),
    # The router counts the tokens of the requests it finished; a worker what its engine did
    # (`workers.service.metrics`), so a prompt split between prefill and decode counts on
    # both and a prompt recomputed after preemption counts again.
    MetricSpec(
        "pdserve_prompt_tokens_total",
        "counter",
        "Prompt tokens: of finished requests (router); run through the model (workers).",
    ),
    MetricSpec(
        "pdserve_generation_tokens_total",
        "counter",
        "Output tokens: of finished requests (router); sampled by the engine (workers).",
    ),
    MetricSpec(
        "pdserve_prefix_cache_queries_total",
        "counter",
        "Prompt tokens looked up in the prefix cache (workers with prefix caching on).",
    ),
    MetricSpec(
        "pdserve_prefix_cache_hits_total",
        "counter",
        "Prompt tokens found in the prefix cache, hence not computed.",
    ),
    # Speculative decoding (vLLM's spec_decode counters): drafts verified, drafts kept.
    MetricSpec(
        "pdserve_spec_decode_num_draft_tokens_total",
        "counter",
        "Draft tokens verified by speculative decoding (decode and mixed workers with it on).",
    ),
    MetricSpec(
        "pdserve_spec_decode_num_accepted_tokens_total",
        "counter",
        "Of the draft tokens verified, those kept (acceptance = kept / verified).",
    ),
    MetricSpec(
        "pdserve_spec_decode_num_accepted_tokens_per_pos_total",
        "counter",
        "Drafts kept, by draft position (a draft is kept only after every one before it).",
        labels=("position",),
    ),
    MetricSpec(
        "pdserve_request_success_total",
        "counter",
        "Requests finished, by finish reason.",
        labels=("finished_reason",),
    ),
    # --- KV cache ------------------------------------------------------------------------------
    MetricSpec("pdserve_kv_pages_used", "gauge", "KV cache pages in use."),
    # Not `_total`: promtool reserves that suffix for counters; used / capacity is the usage.
    MetricSpec("pdserve_kv_pages_capacity", "gauge", "KV cache pages in the pool."),
    MetricSpec(
        "pdserve_kv_pages_pinned_for_transfer",
        "gauge",
        "KV pages held non-evictable for an in-flight transfer.",
    ),
    # --- KV transfer (prefill -> decode) --------------------------------------------------------
    _histogram(
        "pdserve_kv_transfer_seconds",
        "Time from a request's first KV write to its last completion.",
        TRANSFER_BUCKETS,
    ),
    _histogram(
        "pdserve_kv_transfer_bytes",
        "Bytes of KV moved for one request.",
        BYTE_BUCKETS,
    ),
    _histogram(
        "pdserve_kv_transfer_exposed_seconds",
        "Transfer time not hidden behind prefill compute: last forward pass to KV ready.",
        TRANSFER_BUCKETS,
    ),
    MetricSpec(
        "pdserve_kv_transfer_failures_total",
        "counter",
        "KV transfers that failed, by reason.",
        labels=("reason",),
    ),
    MetricSpec(
        "pdserve_kv_messenger_queue_depth",
        "gauge",
        "Transfers in each of the KV messenger's queues.",
        labels=("queue",),
    ),
    MetricSpec(
        "pdserve_kv_checksum_failures_total",
        "counter",
        "KV transfers whose received KV did not match the prefill's checksums (checksum mode).",
    ),
    MetricSpec(
        "pdserve_kv_unauthenticated_messages_total",
        "counter",
        "KV control messages refused for a missing or wrong MAC of the cluster's secret.",
    ),
    MetricSpec(
        "pdserve_kv_transfer_pages_total",
        "counter",
        "A decoder's prompt KV pages: asked of a prefill worker, or held in its prefix cache.",
        labels=("outcome",),
    ),
    # --- router -------------------------------------------------------------------------------
    MetricSpec(
        "pdserve_router_decisions_total",
        "counter",
        "Requests the router assigned to each worker.",
        labels=("worker",),
    ),
    MetricSpec(
        "pdserve_router_retries_total",
        "counter",
        "Requests the router sent again before their first token, by what it changed: the "
        "prefill worker (KV transfer failed) or the serving worker (lost or refusing).",
        labels=("kind",),
    ),
    MetricSpec(
        "pdserve_router_prefill_tokens_in_flight",
        "gauge",
        "Prompt tokens the router sent to each prefill worker whose first token has not come "
        "back: the load it picks prefill workers by.",
        labels=("worker",),
    ),
    MetricSpec(
        "pdserve_router_prefix_index_blocks",
        "gauge",
        "KV page names the router's kv_aware index holds, over all workers.",
    ),
    MetricSpec(
        "pdserve_router_prefix_query_tokens_total",
        "counter",
        "Prompt tokens, in full KV pages, of the requests the kv_aware policy routed.",
    ),
    MetricSpec(
        "pdserve_router_prefix_hit_tokens_total",
        "counter",
        "Of them, tokens the chosen worker was thought to hold cached (the index's estimate).",
    ),
)


class Metrics:
    """Every pdserve metric on ``registry``, with ``role`` and ``model`` bound.

    The attributes are ready-labelled children: ``metrics.time_to_first_token.observe(0.12)``.
    Metrics with an extra label are reached through the methods below, which reject values
    outside the label's vocabulary instead of growing the number of series.
    """

    def __init__(self, registry: CollectorRegistry, *, role: str, model: str) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}; got {role!r}")
        if not model:
            raise ValueError("model must be a non-empty name")
        self.role = role
        self.model = model
        self._counters: dict[str, Counter] = {}
        self._gauges: dict[str, Gauge] = {}
        self._histograms: dict[str, Histogram] = {}
        for spec in METRIC_SPECS:
            self._create(spec, registry)
        self.time_to_first_token = self._bound_histogram("pdserve_time_to_first_token_seconds")
        self.inter_token_latency = self._bound_histogram("pdserve_inter_token_latency_seconds")
        self.e2e_request_latency = self._bound_histogram("pdserve_e2e_request_latency_seconds")
        self.request_queue_time = self._bound_histogram("pdserve_request_queue_time_seconds")
        self.num_requests_running = self._bound_gauge("pdserve_num_requests_running")
        self.num_requests_waiting = self._bound_gauge("pdserve_num_requests_waiting")
        self.prompt_tokens = self._bound_counter("pdserve_prompt_tokens_total")
        self.generation_tokens = self._bound_counter("pdserve_generation_tokens_total")
        self.prefix_cache_queries = self._bound_counter("pdserve_prefix_cache_queries_total")
        self.prefix_cache_hits = self._bound_counter("pdserve_prefix_cache_hits_total")
        self.spec_draft_tokens = self._bound_counter("pdserve_spec_decode_num_draft_tokens_total")
        self.spec_accepted_tokens = self._bound_counter(
            "pdserve_spec_decode_num_accepted_tokens_total"
        )
        self.kv_pages_used = self._bound_gauge("pdserve_kv_pages_used")
        self.kv_pages_capacity = self._bound_gauge("pdserve_kv_pages_capacity")
        self.kv_pages_pinned_for_transfer = self._bound_gauge(
            "pdserve_kv_pages_pinned_for_transfer"
        )
        self.kv_transfer_seconds = self._bound_histogram("pdserve_kv_transfer_seconds")
        self.kv_transfer_bytes = self._bound_histogram("pdserve_kv_transfer_bytes")
        self.kv_transfer_exposed_seconds = self._bound_histogram(
            "pdserve_kv_transfer_exposed_seconds"
        )
        self.kv_checksum_failures = self._bound_counter("pdserve_kv_checksum_failures_total")
        self.kv_unauthenticated_messages = self._bound_counter(
            "pdserve_kv_unauthenticated_messages_total"
        )
        self.router_prefix_index_blocks = self._bound_gauge("pdserve_router_prefix_index_blocks")
        self.router_prefix_query_tokens = self._bound_counter(
            "pdserve_router_prefix_query_tokens_total"
        )
        self.router_prefix_hit_tokens = self._bound_counter(
            "pdserve_router_prefix_hit_tokens_total"
        )
        # Zero-valued series for every closed-vocabulary value (see LABEL_VALUES).
        for spec in METRIC_SPECS:
            for label in spec.labels:
                for value in LABEL_VALUES.get(label, ()):
                    self._family(spec.name).labels(role, model, value)

    # --- labelled metrics ---------------------------------------------------------------------

    def count_request_success(self, finished_reason: str) -> None:
        name = "pdserve_request_success_total"
        self._counters[name].labels(*self._labels(name, "finished_reason", finished_reason)).inc()

    def count_transfer_failure(self, reason: str) -> None:
        name = "pdserve_kv_transfer_failures_total"
        self._counters[name].labels(*self._labels(name, "reason", reason)).inc()

    def count_accepted_at(self, position: int, count: int) -> None:
        """``count`` more drafts kept at draft ``position``."""
        name = "pdserve_spec_decode_num_accepted_tokens_per_pos_total"
        self._counters[name].labels(*self._labels(name, "position", str(position))).inc(count)

    def count_transfer_pages(self, outcome: str, count: int) -> None:
        """``count`` more prompt pages a decoder had ``written`` or ``skipped`` (cached)."""
        name = "pdserve_kv_transfer_pages_total"
        self._counters[name].labels(*self._labels(name, "outcome", outcome)).inc(count)

    def set_queue_depth(self, queue: str, depth: int) -> None:
        name = "pdserve_kv_messenger_queue_depth"
        self._gauges[name].labels(*self._labels(name, "queue", queue)).set(depth)

    def count_router_decision(self, worker_id: str) -> None:
        """One request assigned to ``worker_id`` (a worker of the cluster's registry: bounded
        by the number of workers, unlike request ids)."""
        if not worker_id:
            raise ValueError("worker_id must be a non-empty worker id")
        family = self._counters["pdserve_router_decisions_total"]
        family.labels(self.role, self.model, worker_id).inc()

    def count_router_retry(self, kind: str) -> None:
        name = "pdserve_router_retries_total"
        self._counters[name].labels(*self._labels(name, "kind", kind)).inc()

    def count_router_prefix_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        self.router_prefix_query_tokens.inc(query_tokens)
        self.router_prefix_hit_tokens.inc(hit_tokens)

    def set_prefill_tokens_in_flight(self, worker_id: str, tokens: int) -> None:
        """The router's prefill load on ``worker_id`` (a prefill worker of the registry)."""
        if not worker_id:
            raise ValueError("worker_id must be a non-empty worker id")
        family = self._gauges["pdserve_router_prefill_tokens_in_flight"]
        family.labels(self.role, self.model, worker_id).set(tokens)

    # --- helpers ------------------------------------------------------------------------------

    def _create(self, spec: MetricSpec, registry: CollectorRegistry) -> None:
        labels = list(spec.label_names)
        if spec.kind == "counter":
            # prometheus_client appends `_total` itself.
            name = spec.name.removesuffix("_total")
            self._counters[spec.name] = Counter(name, spec.documentation, labels, registry=registry)
        elif spec.kind == "gauge":
            self._gauges[spec.name] = Gauge(
                spec.name, spec.documentation, labels, registry=registry
            )
        else:
            assert spec.buckets is not None, spec.name
            self._histograms[spec.name] = Histogram(
                spec.name, spec.documentation, labels, registry=registry, buckets=spec.buckets
            )

    def _family(self, name: str) -> Counter | Gauge | Histogram:
        return self._counters.get(name) or self._gauges.get(name) or self._histograms[name]

    def _labels(self, name: str, label: str, value: str) -> tuple[str, str, str]:
        allowed = LABEL_VALUES[label]
        if value not in allowed:
            raise ValueError(f"{name}: {label} must be one of {', '.join(allowed)}; got {value!r}")
        return self.role, self.model, value

    def _bound_histogram(self, name: str) -> Histogram:
        return self._histograms[name].labels(self.role, self.model)

    def _bound_gauge(self, name: str) -> Gauge:
        return self._gauges[name].labels(self.role, self.model)

    def _bound_counter(self, name: str) -> Counter:
        return self._counters[name].labels(self.role, self.model)


def serve_metrics(
    registry: CollectorRegistry, host: str = "0.0.0.0", port: int = 0
) -> tuple[WSGIServer, int]:
    """Serve ``registry`` at ``http://host:port/metrics`` from a daemon thread.

    ``port`` 0 takes a free port; the port bound is returned with the server. Stop it with
    ``server.shutdown(); server.server_close()``.
    """
    server, _thread = start_wsgi_server(port, addr=host, registry=registry)
    bound_port = int(server.server_port)
    logger.info("serving metrics at http://%s:%d/metrics", host, bound_port)
    return server, bound_port
