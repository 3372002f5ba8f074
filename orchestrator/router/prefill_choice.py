"""Disaggregated serving: which prefill worker fills a request's KV, and which one next when its
KV transfer failed before the first token.

The first choice and every retry go to the ready prefill worker with the fewest prompt tokens
in flight from this router (`PrefillLoad`), among those the request has not tried; the request's
prompt is charged there (`PrefillCharge`) until its prefill is over (first token) or will not
happen (error, retry, end). With none left, ``local_prefill_fallback`` lets the decoder prefill
the request itself, once (an empty prefill endpoint).
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.control.registry import Registry, WorkerRecord
from orchestrator.router.policy import PrefillLoad
from orchestrator.router.prefix_index import PrefixIndex, PromptPages
from orchestrator.router.types import RouterSettings
from workers.metrics import Metrics

# The source of a request the decoder prefills itself, in a request's set of tried sources.
DECODER_ITSELF = ""


@dataclass
class PrefillCharge:
    """One request's prompt tokens, charged to its prefill source in `PrefillLoad` (``source``
    "": none, or released); ``charged``: the part of them charged there (less what it holds
    cached, with ``kv_aware``); ``prompt``: the prompt's pages (``kv_aware``)."""

    tokens: int = 0
    source: str = ""
    charged: int = 0
    prompt: PromptPages | None = None


class PrefillChoice:
    def __init__(
        self,
        registry: Registry,
        metrics: Metrics | None,
        seed: int | None,
        index: PrefixIndex | None = None,
    ) -> None:
        """``index``: ``kv_aware``'s prompt-prefix index (the prefill workers' part of it)."""
        self.registry = registry
        self.metrics = metrics
        self.load = PrefillLoad(seed)
        self.index = index

    def source(
        self, charge: PrefillCharge, tried: set[str], settings: RouterSettings
    ) -> bytes | None:
        """The endpoint of the least-loaded ready prefill worker not in ``tried`` (charged);
        else, with ``local_prefill_fallback``, b"": the decoder prefills the request itself,
        once; else None. The choice is added to ``tried``."""
        others = [w for w in self.registry.ready("prefill") if w.worker_id not in tried]
        if others:
            worker = self._charge(charge, others)
            tried.add(worker.worker_id)
            return worker.prefill_endpoint
        if settings.local_prefill_fallback and DECODER_ITSELF not in tried:
            tried.add(DECODER_ITSELF)
            return b""
        return None

    def retry_source(
        self,
        charge: PrefillCharge,
        tried: set[str],
        settings: RouterSettings,
        *,
        num_tokens: int,
        error_code: int,
    ) -> bytes | None:
        """Another source (`source`) for a request whose decoder failed it before any token
        with a worker-side error (``error_code`` 0: not a refusal of the request itself), while
        ``prefill_retries`` allows; None otherwise."""
        if (
            not settings.is_disaggregated
            or num_tokens > 0
            or error_code != 0
            or len(tried) > settings.prefill_retries
        ):
            return None
        return self.source(charge, tried, settings)

    def release(self, charge: PrefillCharge) -> None:
        """The request's prefill is over (first token) or will not happen (error, retry, end)."""
        worker_id, charge.source = charge.source, ""
        if worker_id:
            self.load.release(worker_id, charge.charged)
            self._gauge(worker_id)

    def _charge(self, charge: PrefillCharge, workers: list[WorkerRecord]) -> WorkerRecord:
        """Charge the request's prompt to the least-loaded of ``workers`` and make it the
        request's source (`release` undoes both)."""
        index, prompt = self.index, charge.prompt
        cached = None
        if index is not None and prompt is not None:

            def cached(worker: WorkerRecord) -> int:
                return index.matched_tokens(worker, prompt)

        worker, charge.charged = self.load.pick(workers, charge.tokens, cached)
        if index is not None and prompt is not None:
            index.record(worker, prompt)  # its cache will hold them
        charge.source = worker.worker_id
        self._gauge(worker.worker_id)
        return worker

    def _gauge(self, worker_id: str) -> None:
        if self.metrics is not None:
            self.metrics.set_prefill_tokens_in_flight(worker_id, self.load.tokens(worker_id))
