"""What a worker actor serves: an engine in one role behind a thread-safe, callback-based API.

The contract (`WorkerBackend`): ``submit`` validates and starts a request, raising the engine's
`InvalidRequestError` / `CapacityError` before anything is allocated; its tokens then reach the
request's ``sink`` as `TokenDelta`s, ending with exactly one ``finished`` delta. Sinks run on
the backend's step thread and must only enqueue (the gRPC worker service hands them to its
event loop). ``abort`` ends a request wherever it is and frees its pages.

Backends:

- `MixedBackend`: a mixed-role `EngineCore` driven by its own step thread (colocated baseline).
- `workers.service.kv_backends.DecodeBackend` / `PrefillBackend`: the KV workers of
  `workers.service.kv_worker` (engine + KV messenger + fabric) in the disaggregated roles.

`workers.service.factory.create_backend` picks one by role (it sits above both modules: the KV
backends build on this contract).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from workers.engine.cache_events import CacheEventBatch
from workers.engine.config import EngineConfig
from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import SamplingParams
from workers.engine.step_loop import StepLoop
from workers.wire import CacheNaming, TokenDelta, WorkerLoad

if TYPE_CHECKING:
    from workers.engine.engine_core import EngineCore

logger = logging.getLogger(__name__)


Sink = Callable[[TokenDelta], None]


def cache_naming(engine: EngineCore) -> CacheNaming | None:
    salt = engine.cache_salt
    return None if salt is None else CacheNaming(salt, engine.config.page_size)


def engine_counters(engine: EngineCore) -> dict[str, Any]:
    """`WorkerLoad`'s two counters, from the engine's `EngineStats`."""
    stats = engine.stats
    return {
        "num_computed_prompt_tokens": stats.num_computed_prompt_tokens,
        "num_sampled_tokens": stats.num_sampled_tokens,
        "num_prefix_cache_queries": stats.num_prefix_cache_queries,
        "num_prefix_cache_hits": stats.num_prefix_cache_hits,
        "num_spec_draft_tokens": stats.num_draft_tokens,
        "num_spec_accepted_tokens": stats.num_accepted_tokens,
        "num_spec_accepted_per_pos": tuple(stats.num_accepted_tokens_per_pos),
    }


class WorkerBackend(Protocol):
    role: str

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        prefill_endpoint: bytes,
        sink: Sink,
    ) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def load(self) -> WorkerLoad: ...

    def transfer_stats(self, request_id: str) -> dict[str, Any] | None:
        """KV transfer record of a recent request (prefill / decode roles); None otherwise.
        ``request_id``: the router's worker request id, or a client's id (its latest attempt)."""
        ...

    def step_trace(self) -> dict[str, Any]:
        """The engine's recent steps, as plain data (`workers.engine.step_trace`)."""
        ...

    def prefill_endpoint(self) -> bytes:
        """Prefill role: the serialized `PrefillEndpoint` decoders connect to; b"" otherwise."""
        ...

    def cache_naming(self) -> CacheNaming | None:
        """How the engine names its cached pages (None: prefix caching off)."""
        ...

    def cache_events(self, full: bool = False) -> CacheEventBatch | None:
        """The page names the prefix cache gained and lost since the last call (the first, or
        with ``full``: all it holds, as a reset); None with caching off."""
        ...

    def close(self) -> None: ...


class MixedBackend:
    """A mixed-role `EngineCore`: prefill chunks and decodes share each step."""

    role = "mixed"

    def __init__(self, model_dir: str | Path, config: EngineConfig) -> None:
        from workers.engine.engine_core import EngineCore

        # The router detokenizes; the engine still decodes text when a request has stop strings.
        self.engine = EngineCore(model_dir, config, detokenize=False)
        self._sinks: dict[str, Sink] = {}
        self._loop = StepLoop(
            "mixed-step", self.engine, self._on_outputs, on_error=self._on_loop_error
        )
        self._loop.thread.start()

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        prefill_endpoint: bytes,
        sink: Sink,
    ) -> None:
        def start() -> None:
            self.engine.add_request(request_id, prompt_token_ids, params)
            self._sinks[request_id] = sink

        # Undone if it timed out while running: the caller reports an error, and the request
        # must not run on unread.
        self._loop.call(start, undo=lambda: self.engine.abort(request_id))

    def abort(self, request_id: str) -> None:
        self._loop.call(lambda: self.engine.abort(request_id))

    def load(self) -> WorkerLoad:
        def load() -> WorkerLoad:
            if self.engine.tp is not None:
                # A follower that died while the worker idles fails the health check now,
                # not the next request.
                self.engine.tp.check_healthy()
            scheduler = self.engine.scheduler
            return WorkerLoad(
                num_running_requests=len(scheduler.running),
                num_waiting_requests=len(scheduler.waiting),
                num_free_kv_pages=self.engine.block_manager.num_free_pages,
                num_total_kv_pages=self.engine.num_pages,
                **engine_counters(self.engine),
            )

        return self._loop.call(load)

    def transfer_stats(self, request_id: str) -> dict[str, Any] | None:
        return None

    def step_trace(self) -> dict[str, Any]:
        return self._loop.trace_snapshot()

    def prefill_endpoint(self) -> bytes:
        return b""

    def cache_naming(self) -> CacheNaming | None:
        return cache_naming(self.engine)

    def cache_events(self, full: bool = False) -> CacheEventBatch | None:
        return self._loop.call(lambda: self.engine.drain_cache_events(full))

    def close(self) -> None:
        """Stop the step thread, end every open stream, then stop the engine's TP ranks."""
        try:
            self._loop.stop()
            self._end_streams("worker closed")
        finally:
            self.engine.close()

    def _on_loop_error(self, error: BaseException) -> None:
        """Step thread, after the loop died: no stream will get another token."""
        self._end_streams(f"engine failed: {error!r}")

    def _end_streams(self, error: str) -> None:
        sinks, self._sinks = self._sinks, {}
        for request_id, sink in sinks.items():
            try:
                sink(TokenDelta([], None, True, "error", error))
            except Exception:  # one consumer's bug must not keep the others' streams open
                logger.exception("sink of %s failed", request_id)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if sink is None:
                continue
            if output.finished:
                del self._sinks[output.request_id]
            sink(
                TokenDelta(
                    list(output.new_token_ids),
                    list(output.logprobs) if output.logprobs is not None else None,
                    output.finished,
                    output.finish_reason,
                )
            )
