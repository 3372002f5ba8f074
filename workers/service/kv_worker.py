"""Workers: an engine, a fabric `TransferEngine` (one per NIC: `NicSet`) and a KV messenger in one
role.

Each worker runs one **step thread** that alone touches the engine and the messenger's request
state::

    loop: run queued API calls ─▶ messenger.poll() ─▶ engine.step() (if work) ─▶ route outputs
          (idle: wait until a call, a fabric message or a completion wakes it)

The caller's API (`DecodeWorker.submit` / `abort` / `state`, `PrefillWorker.endpoint` /
`state`) is thread-safe: calls are shipped to the step thread and their results returned.
Outputs of a request go to its `OutputStream`, or, when `DecodeWorker.submit` got an
``on_output`` callback, to that callback, called on the step thread in the step that produced
the output (it must only enqueue: it runs where the engine steps). The types are plain dataclasses so the next layer
(Ray actors, the gRPC router) can wrap them without pickling anything onto a wire.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Protocol, TypeVar

from workers.engine.cache_events import CacheEventBatch
from workers.engine.config import EngineConfig
from workers.engine.engine_core import EngineCore
from workers.engine.errors import EngineClosedError
from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import SamplingParams
from workers.engine.step_loop import StepLoop
from workers.fabric import NicSet, TransferEngine
from workers.kv.decode_messenger import DecodeMessenger, DecodeMessengerConfig
from workers.kv.endpoint import PrefillEndpoint
from workers.kv.prefill_messenger import PrefillMessenger, PrefillMessengerConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerOutput:
    """New tokens of one request; ``error`` is set when it failed (``finish_reason='error'``);
    ``logprobs``: one per new token when the request asked for them (`SamplingParams.logprobs`),
    else None."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    error: str | None = None
    logprobs: list[float] | None = None


OutputCallback = Callable[[WorkerOutput], None]


def _check_fabric(fabric: NicSet) -> None:
    """Raise once the KV fabric takes no more work (its watchdog abandoned it: a post that
    never returned): a request sent here is refused (`EngineClosedError`, UNAVAILABLE: the
    router sends it to another worker), and `state` fails, so the control plane's health check
    replaces the worker. Any of the worker's NICs lost counts: a request's writes may go
    through each."""
    reason = fabric.closed_reason()
    if reason is not None:
        raise EngineClosedError(f"KV fabric unusable: {reason}")


class OutputStream:
    """The outputs of one request, in order; iterate until the finished one.

    With an ``on_output`` callback the outputs go to the callback instead of the queue (so
    `get` / `result` / iteration then see nothing).
    """

    def __init__(self, request_id: str, on_output: OutputCallback | None = None) -> None:
        self.request_id = request_id
        self._queue: queue.SimpleQueue[WorkerOutput] = queue.SimpleQueue()
        self._on_output = on_output

    def put(self, output: WorkerOutput) -> None:
        """Called on the step thread for every output of the request."""
        if self._on_output is None:
            self._queue.put(output)
            return
        try:
            self._on_output(output)
        except Exception:  # a consumer's bug must not take the step thread down
            log.exception("on_output callback of %s failed", self.request_id)

    def get(self, timeout: float | None = None) -> WorkerOutput:
        return self._queue.get(timeout=timeout)

    def __iter__(self) -> Iterator[WorkerOutput]:
        while True:
            output = self._queue.get()
            yield output
            if output.finished:
                return

    def result(self, timeout: float = 60.0) -> tuple[list[int], WorkerOutput]:
        """All tokens and the final output (raises `queue.Empty` after ``timeout`` per output)."""
        tokens: list[int] = []
        while True:
            output = self.get(timeout)
            tokens.extend(output.new_token_ids)
            if output.finished:
                return tokens, output


def _engine_config(config: EngineConfig | None, role: str) -> EngineConfig:
    config = config or EngineConfig()
    return replace(config, role=role)  # type: ignore[arg-type]


def group_pools(engine: EngineCore) -> dict[str, Any]:
    """The messenger's view of the engine's TP group: every rank's pool and the head placement.

    One rank: the engine's own pool, one rank holding every head (the messengers' defaults).
    ``tensor_parallel_size > 1``: the leader's pool and the followers' pools mapped into this
    process (``engine.rank_kv_caches``, rank order), all registered with the leader's single
    `TransferEngine`, placed by the engine's own `GroupSharding` (``tp.spec.kv_sharding``), so
    the transfer plans use exactly the heads each rank computes.
    """
    if engine.tp is None:
        return {}
    return {"rank_pools": list(engine.rank_kv_caches), "sharding": engine.tp.spec.kv_sharding}


def open_fabric(
    engine: EngineCore, provider: str, node: str | None, nics: Sequence[str] = ()
) -> NicSet:
    """The worker's transfer engines: one on ``node``, or one per entry of ``nics`` (interface
    names or addresses of this host, `workers.fabric.nics`; the first is the primary); with
    FI_HMEM when the KV pool is GPU memory, so the provider moves pages between GPUs directly
    (`TransferEngine` docstring)."""
    hmem = engine.device.type == "cuda"
    if nics:
        return NicSet.open(provider, nics, hmem=hmem)
    return NicSet([TransferEngine(provider, node, hmem=hmem)])


class _StepHooks(Protocol):
    """What a worker gives its step loop (called on the loop's thread once it starts)."""

    def _on_outputs(self, outputs: list[RequestOutput]) -> None: ...
    def _poll(self) -> Any: ...
    def _has_work(self) -> bool: ...
    def _on_loop_error(self, error: BaseException) -> None: ...


M = TypeVar("M")


def _assemble(
    worker: _StepHooks,
    role: str,
    model_dir: str | Path,
    engine_config: EngineConfig | None,
    provider: str,
    node: str | None,
    nics: Sequence[str],
    messenger: Callable[..., M],
) -> tuple[EngineCore, NicSet, StepLoop, M]:
    """A worker's parts: its engine in ``role``, fabric (`open_fabric`), step loop (not
    started) and messenger, each one closed again if a later one fails to build."""
    engine = EngineCore(model_dir, _engine_config(engine_config, role), detokenize=False)
    try:
        fabric = open_fabric(engine, provider, node, nics)
    except BaseException:
        engine.close()
        raise
    try:
        loop = StepLoop(
            f"{role}-step",
            engine,
            worker._on_outputs,
            poll=worker._poll,
            has_work=worker._has_work,
            on_error=worker._on_loop_error,
        )
        built = messenger(
            engine,
            fabric.primary,
            wake=loop.wake,
            extra_nics=fabric.extra,
            **group_pools(engine),
        )
    except BaseException:
        fabric.close()
        engine.close()
        raise
    return engine, fabric, loop, built


class PrefillWorker:
    """A prefill-role engine whose prefilled KV is pushed to decoders (no sampling)."""

    def __init__(
        self,
        model_dir: str | Path,
        engine_config: EngineConfig | None = None,
        *,
        provider: str = "tcp;ofi_rxm",
        node: str | None = "127.0.0.1",
        nics: Sequence[str] = (),
        messenger_config: PrefillMessengerConfig | None = None,
    ) -> None:
        """``nics``: one transfer engine per entry instead of one on ``node``
        (`open_fabric`)."""
        self.engine, self.nics, self._loop, self.messenger = _assemble(
            self,
            "prefill",
            model_dir,
            engine_config,
            provider,
            node,
            nics,
            partial(PrefillMessenger, config=messenger_config),
        )
        self.fabric = self.nics.primary  # the address decoders know; control messages
        # After the step loop died: the thread that answers decoders in its place.
        self._orphan_poller: threading.Thread | None = None
        self._orphan_stop = threading.Event()
        self._orphan_wake = threading.Event()
        self._loop.thread.start()

    def _poll(self) -> None:
        self.messenger.poll()

    def _on_loop_error(self, error: BaseException) -> None:
        """The step loop died (its thread, last act): every decoder with a live transfer is told
        at once (`PrefillMessenger.engine_failed`), and a thread of its own keeps the messenger
        answering (new requests refused, aborts acknowledged with their counts, completions of
        writes still in flight drained) until `close`. Left unpolled, each decoder would wait
        for its transfer deadline; the worker's `state` raises from now on, so its health check
        fails and the control plane replaces it."""
        try:
            self.messenger.engine_failed(f"prefill engine failed: {error!r}")
        finally:  # even if that failed too, aborts must still be answered
            self._orphan_poller = threading.Thread(
                target=self._poll_orphaned, name="prefill-orphaned", daemon=True
            )
            self._orphan_poller.start()

    def _poll_orphaned(self) -> None:
        wake = self._orphan_wake
        self.messenger.set_wake(wake.set)
        logged = False
        while not self._orphan_stop.is_set():
            try:
                self.messenger.poll()
            except Exception:  # keep answering: one bad message must not silence the rest
                if not logged:  # the same fault may recur on every poll: log it once
                    log.exception("polling the orphaned prefill messenger failed")
                    logged = True
            wake.wait(0.02)
            wake.clear()

    def _has_work(self) -> bool:
        return self.messenger.has_work()

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        self.messenger.after_step(outputs)

    def endpoint(self) -> PrefillEndpoint:
        config = self.engine.config
        budget_pages = config.max_num_batched_tokens // config.page_size
        segment_pages = budget_pages if config.enable_chunked_prefill else 0
        return PrefillEndpoint(
            self.fabric.address,
            self.fabric.provider,
            self.messenger.sharding.tp_size,
            self.messenger.sharding.num_kv_heads,
            self.messenger.sharding.is_mla,
            segment_pages,
            config.page_size,
            self.messenger.incarnation,
        )

    def state(self) -> dict[str, Any]:
        _check_fabric(self.nics)
        return self._loop.call(self.messenger.state)

    def transfer_stats(self, request_id: str) -> dict[str, Any] | None:
        return self._loop.call(lambda: self.messenger.finished.get(request_id))

    def step_trace(self) -> dict[str, Any]:
        """The engine's recent steps (`workers.engine.step_trace`)."""
        return self._loop.trace_snapshot()

    def cache_events(self, full: bool = False) -> CacheEventBatch | None:
        """The prefix cache's changes since the last call (`EngineCore.drain_cache_events`)."""
        return self._loop.call(lambda: self.engine.drain_cache_events(full))

    def finished_transfers(self) -> dict[str, dict[str, Any]]:
        """Records of recently ended transfers by request id, oldest first (bounded memory)."""
        return self._loop.call(lambda: dict(self.messenger.finished))

    def close(self, drain_timeout_s: float = 5.0) -> None:
        """Graceful close: give up every live transfer (each decoder gets `PrefillFailed` with
        reason DRAINING at once, new requests are rejected), wait up to ``drain_timeout_s`` for
        in-flight writes and those messages, then stop the step thread, the messenger and the
        fabric, then the engine's TP ranks."""
        deadline = time.monotonic() + drain_timeout_s
        try:
            self._loop.call(self.messenger.shutdown, timeout=drain_timeout_s)
            drained = partial(self._loop.call, self.messenger.is_drained, timeout=drain_timeout_s)
            if not _wait_until(drained, deadline):
                log.warning("prefill worker closing with transfers not drained")
        except EngineClosedError:  # the loop died: its orphan poller drains (below)
            pass
        except Exception:  # close what is left regardless
            log.exception("prefill worker could not drain before closing")
        self._loop.stop()  # joins the loop thread: a death's on_error has run
        if self._orphan_poller is not None:
            # Given-up transfers' in-flight writes and the answers to decoders complete first.
            _wait_until(self.messenger.is_drained, deadline)
            self._orphan_stop.set()
            self._orphan_wake.set()
            self._orphan_poller.join(5.0)
        try:
            self.messenger.close()
            self.nics.close()
        finally:
            self.engine.close()


def _wait_until(condition: Callable[[], bool], deadline: float) -> bool:
    """Poll ``condition`` until it holds (True) or ``deadline`` (monotonic) passed (False)."""
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


class DecodeWorker:
    """A decode-role engine whose prompts are prefilled by prefill workers."""

    def __init__(
        self,
        model_dir: str | Path,
        engine_config: EngineConfig | None = None,
        *,
        provider: str = "tcp;ofi_rxm",
        node: str | None = "127.0.0.1",
        nics: Sequence[str] = (),
        messenger_config: DecodeMessengerConfig | None = None,
    ) -> None:
        """``nics``: one transfer engine per entry instead of one on ``node``
        (`open_fabric`)."""
        self._streams: dict[str, OutputStream] = {}
        self.engine, self.nics, self._loop, self.messenger = _assemble(
            self,
            "decode",
            model_dir,
            engine_config,
            provider,
            node,
            nics,
            partial(DecodeMessenger, config=messenger_config),
        )
        self.fabric = self.nics.primary  # the address prefill workers answer
        self._loop.thread.start()

    # -- caller API (any thread) ------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        prefill: PrefillEndpoint | None,
        *,
        on_output: OutputCallback | None = None,
    ) -> OutputStream:
        """Start a request; raises the engine's `InvalidRequestError` / `CapacityError`.

        ``prefill``: the worker that computes its prompt's KV; None prefills it here, in this
        worker's own steps (the router's fallback while no prefill worker is ready).

        Outputs go to the returned `OutputStream`, or, with ``on_output``, to that callback
        instead: it is called on the worker's step thread for every output of the request, in
        order, in the step that produced it (the finished one included: a final token is never
        held back), from the moment the request is registered, so none is missed even if the
        request ends before `submit` returns. It must not block nor call the worker (that would
        deadlock the step thread): hand the output to another thread or loop and return, e.g.
        ``loop.call_soon_threadsafe(queue.put_nowait, output)``. An exception it raises is
        logged and ignored.
        """
        stream = OutputStream(request_id, on_output)
        prompt = list(prompt_ids)

        def start() -> None:
            _check_fabric(self.nics)
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already active")
            self.engine.validate(request_id, prompt, params)
            self._streams[request_id] = stream
            try:
                if prefill is None:
                    self.engine.add_request(request_id, prompt, params)
                else:
                    self.messenger.start(request_id, prompt, params, prefill)
            except BaseException:
                del self._streams[request_id]
                raise

        # Undone if it timed out while running: the caller reports an error, and the request
        # must not run on unread.
        self._loop.call(start, undo=partial(self._abort_here, request_id))
        return stream

    def abort(self, request_id: str) -> bool:
        """End a request wherever it is; its stream gets a final ``abort`` output."""
        return self._loop.call(partial(self._abort_here, request_id))

    def _abort_here(self, request_id: str) -> bool:
        """`abort`, on the step thread."""
        if self.messenger.abort(request_id):
            self._emit(WorkerOutput(request_id, [], True, "abort"))
            return True
        return self.engine.abort(request_id)

    def state(self) -> dict[str, Any]:
        _check_fabric(self.nics)

        def state() -> dict[str, Any]:
            if self.engine.tp is not None:
                # A follower that died while the worker idles fails the health check now,
                # not the next request.
                self.engine.tp.check_healthy()
            block_manager = self.engine.block_manager
            return {
                "num_free_pages": block_manager.num_free_pages,
                "num_pinned_pages": block_manager.num_pinned_pages,
                "num_pages": self.engine.num_pages,
                "num_requests": len(self._streams),
                **self.messenger.state(),
            }

        return self._loop.call(state)

    def transfer_stats(self, request_id: str) -> dict[str, Any] | None:
        return self._loop.call(lambda: self.messenger.finished.get(request_id))

    def step_trace(self) -> dict[str, Any]:
        """The engine's recent steps (`workers.engine.step_trace`)."""
        return self._loop.trace_snapshot()

    def cache_events(self, full: bool = False) -> CacheEventBatch | None:
        """The prefix cache's changes since the last call (`EngineCore.drain_cache_events`)."""
        return self._loop.call(lambda: self.engine.drain_cache_events(full))

    def finished_transfers(self) -> dict[str, dict[str, Any]]:
        """Records of recently ended transfers by request id, oldest first (bounded memory)."""
        return self._loop.call(lambda: dict(self.messenger.finished))

    def transfer_progress(self, request_id: str) -> tuple[int, int | None] | None:
        """``(writes landed, writes expected)`` while the request waits for its KV."""
        return self._loop.call(lambda: self.messenger.progress(request_id))

    def peer_incarnation(self, address: bytes) -> int | None:
        """The incarnation of the prefill worker at ``address`` this decoder last used."""
        return self._loop.call(lambda: self.messenger.peer_incarnations.get(address))

    def context_state(self, request_id: str) -> Any:
        """The hidden state of the last prefilled position the prefill worker wrote (a tensor)."""
        return self._loop.call(lambda: self.messenger.context_states.get(request_id))

    def imm_writes_received(self) -> int:
        """Every KV / context write that landed here (the fabric's immediate counter stats)."""
        return self.fabric.stats().imm.received

    def close(self) -> None:
        """Stop the step thread, the messenger and the fabric, then the engine's TP ranks."""
        self._loop.stop()
        try:
            self.messenger.close()
            self.nics.close()
        finally:
            self.engine.close()
        self._end_streams("worker closed")

    # -- step thread ------------------------------------------------------------------------

    def _poll(self) -> None:
        for request_id, error in self.messenger.poll():
            self._emit(WorkerOutput(request_id, [], True, "error", error))

    def _has_work(self) -> bool:
        return bool(self.messenger.state()["num_transfers"] or self.messenger.quarantine)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self._emit(
                WorkerOutput(
                    output.request_id,
                    list(output.new_token_ids),
                    output.finished,
                    output.finish_reason,
                    logprobs=list(output.logprobs) if output.logprobs is not None else None,
                )
            )

    def _on_loop_error(self, error: BaseException) -> None:
        """The step loop died: no stream will get another output, so end them all."""
        self._end_streams(f"engine failed: {error!r}")

    def _end_streams(self, reason: str) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(WorkerOutput(stream.request_id, [], True, "error", reason))

    def _emit(self, output: WorkerOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        if output.finished:
            del self._streams[output.request_id]
        stream.put(output)
