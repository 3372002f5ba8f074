"""Worker backends of the disaggregated roles, over `workers.service.kv_worker` (engine + KV messenger
+ fabric): `DecodeBackend` (the router names the prefill worker per request) and
`PrefillBackend` (takes no requests from the router; publishes its endpoint for decoders).
Contract: `workers.service.backend.WorkerBackend`.

``load()`` gets the messenger's numbers through the worker's step loop (``state()``) but reads
the scheduler's queue lengths and the `EngineStats` token counters from the caller's thread:
the step thread is their only writer and each is one int read whole, so every number is one it
really had (counters never go back), though not all from the same instant.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.engine.cache_events import CacheEventBatch
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams
from workers.service.backend import Sink, cache_naming, engine_counters
from workers.wire import CacheNaming, TokenDelta, WorkerLoad, client_request_id

if TYPE_CHECKING:
    from workers.service.kv_worker import DecodeWorker, PrefillWorker, WorkerOutput

logger = logging.getLogger(__name__)


class DecodeBackend:
    """`DecodeWorker`: prompts prefilled by the prefill worker the router names.

    Outputs reach the sink through the worker's ``on_output`` callback, on its step thread, in
    the step that produced them; the sink only enqueues (contract of `Sink`).
    """

    role = "decode"

    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig,
        provider: str,
        node: str | None,
        transfer: dict[str, Any],
        secret: bytes | None = None,
        nics: Sequence[str] = (),
    ) -> None:
        from workers.kv.decode_messenger import DecodeMessengerConfig
        from workers.service.kv_worker import DecodeWorker

        messenger = DecodeMessengerConfig(
            transfer_timeout_s=transfer.get("deadline_seconds", 30.0),
            drain_interval_s=transfer.get("drain_interval_seconds", 5.0),
            liveness_interval_s=transfer.get("liveness_interval_seconds", 1.0),
            coalesce_pages=transfer.get("coalesce_pages", True),
            checksum=transfer.get("checksum", False),
            secret=secret,
        )
        self.worker: DecodeWorker = DecodeWorker(
            model_dir, config, provider=provider, node=node, nics=nics, messenger_config=messenger
        )

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        prefill_endpoint: bytes,
        sink: Sink,
    ) -> None:
        from workers.engine.errors import InvalidRequestError
        from workers.kv.endpoint import PrefillEndpoint
        from workers.kv.errors import ProtocolError

        endpoint = None  # none given: the router's local-prefill fallback
        if prefill_endpoint:
            try:
                endpoint = PrefillEndpoint.from_bytes(prefill_endpoint)
            except ProtocolError as error:
                raise InvalidRequestError(f"bad prefill endpoint: {error}") from None

        def on_output(output: WorkerOutput) -> None:  # step thread: only enqueues
            sink(
                TokenDelta(
                    list(output.new_token_ids),
                    output.logprobs,
                    output.finished,
                    output.finish_reason,
                    output.error,
                )
            )

        self.worker.submit(request_id, prompt_token_ids, params, endpoint, on_output=on_output)

    def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)

    def load(self) -> WorkerLoad:
        state = self.worker.state()
        scheduler = self.worker.engine.scheduler
        return WorkerLoad(
            num_running_requests=len(scheduler.running),
            num_waiting_requests=max(0, int(state["num_requests"]) - len(scheduler.running)),
            num_free_kv_pages=int(state["num_free_pages"]),
            num_total_kv_pages=int(state["num_pages"]),
            num_transfers_in_flight=int(state.get("num_transfers", 0)),
            num_unauthenticated_messages=int(state.get("num_unauthenticated_messages", 0)),
            num_kv_pages_written=int(state.get("num_pages_requested", 0)),
            num_kv_pages_skipped=int(state.get("num_pages_skipped", 0)),
            **engine_counters(self.worker.engine),  # off the step thread: module docstring
        )

    def transfer_stats(self, request_id: str) -> dict[str, Any] | None:
        return _transfer_stats(self.worker, request_id)

    def step_trace(self) -> dict[str, Any]:
        return self.worker.step_trace()

    def prefill_endpoint(self) -> bytes:
        return b""

    def cache_naming(self) -> CacheNaming | None:
        return cache_naming(self.worker.engine)

    def cache_events(self, full: bool = False) -> CacheEventBatch | None:
        return self.worker.cache_events(full)

    def close(self) -> None:
        self.worker.close()  # ends every open request with a final "worker closed" output


class PrefillBackend:
    """`PrefillWorker`: fills decoders' KV pages; the router never sends it requests."""

    role = "prefill"

    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig,
        provider: str,
        node: str | None,
        secret: bytes | None = None,
        nics: Sequence[str] = (),
    ):
        from workers.kv.prefill_messenger import PrefillMessengerConfig
        from workers.service.kv_worker import PrefillWorker

        self.worker: PrefillWorker = PrefillWorker(
            model_dir,
            config,
            provider=provider,
            node=node,
            nics=nics,
            messenger_config=PrefillMessengerConfig(secret=secret),
        )
        self._endpoint = self.worker.endpoint().to_bytes()

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        prefill_endpoint: bytes,
        sink: Sink,
    ) -> None:
        from workers.engine.errors import InvalidRequestError

        raise InvalidRequestError("prefill workers take requests from decoders only")

    def abort(self, request_id: str) -> None:
        return None

    def load(self) -> WorkerLoad:
        state = self.worker.state()
        engine = self.worker.engine
        return WorkerLoad(
            num_running_requests=len(engine.scheduler.running),
            num_waiting_requests=len(engine.scheduler.waiting),
            num_free_kv_pages=engine.block_manager.num_free_pages,
            num_total_kv_pages=engine.num_pages,
            num_transfers_in_flight=int(state.get("num_transfers", 0)),
            num_unauthenticated_messages=int(state.get("num_unauthenticated_messages", 0)),
            **engine_counters(engine),  # off the step thread: module docstring
        )

    def transfer_stats(self, request_id: str) -> dict[str, Any] | None:
        return _transfer_stats(self.worker, request_id)

    def step_trace(self) -> dict[str, Any]:
        return self.worker.step_trace()

    def prefill_endpoint(self) -> bytes:
        return self._endpoint

    def cache_naming(self) -> CacheNaming | None:
        return cache_naming(self.worker.engine)

    def cache_events(self, full: bool = False) -> CacheEventBatch | None:
        return self.worker.cache_events(full)

    def close(self) -> None:
        self.worker.close()


def _transfer_stats(worker: DecodeWorker | PrefillWorker, request_id: str) -> dict[str, Any] | None:
    """The record of ``request_id``: a worker request id, or a client's id, whose latest attempt
    it then is (workers know requests by the router's per-attempt ids, `worker_request_id`)."""
    record = worker.transfer_stats(request_id)
    if record is not None:
        return record
    attempts = [
        stats
        for worker_request, stats in worker.finished_transfers().items()  # oldest first
        if client_request_id(worker_request) == request_id
    ]
    return attempts[-1] if attempts else None
