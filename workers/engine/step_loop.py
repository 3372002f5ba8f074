"""The one thread that drives an `EngineCore` (the engine is not thread-safe).

    loop: run shipped calls ─▶ poll() ─▶ engine.step() (if work) ─▶ on_outputs(outputs)
          (idle, or a step that could schedule nothing: wait until a call or ``wake()``;
          shorter waits while ``has_work()``)

Other threads reach the engine only through ``call(function)``, which runs ``function`` on this
thread and returns its result. Used by the KV workers (``poll`` / ``has_work`` drive the
messenger) and by the colocated worker backend (no messenger). A call that times out is
cancelled unless its function already started (`EngineCallTimeoutError.started`): a late run
would act for a caller that gave up.

With ``EngineConfig.min_step_interval_s`` set, a step that would only decode starts no sooner
than that after the previous step started (calls are still run meanwhile): on cores it shares
with other workers, a decoder stepping as fast as it can spends CPU they need on steps of one
or two rows, each reading every weight once, as a step of several rows would.
A step with prompt work (a prompt, or a chunk of one, to compute; a decoder's arrived KV to
admit) starts at once: pacing never delays a first token.

A step that schedules nothing (every waiting request blocked by pages held for transfers) waits
too: spinning would hold the GIL against the messenger and fabric threads that free the pages;
whatever frees them calls ``wake()``.

Closing: once ``stop()`` is called or the loop dies, the loop is *closed*: ``call`` raises
`EngineClosedError` at once, and calls queued before that are run (stop) or failed with it
(death). When the loop dies, ``on_error(error)`` runs on the loop thread, so the owner can end
the requests it still streams.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from workers.engine.errors import EngineCallTimeoutError, EngineClosedError
from workers.engine.step_trace import StepTrace

if TYPE_CHECKING:
    from workers.engine.engine_core import EngineCore
    from workers.engine.outputs import RequestOutput

log = logging.getLogger(__name__)

T = TypeVar("T")
_BUSY_WAIT_S = 0.02  # wake-ups for deadlines while ``has_work()`` (e.g. transfers in flight)
_IDLE_WAIT_S = 0.05


def _nothing() -> None:
    return None


def _no_work() -> bool:
    return False


def _undo_if_done(call: Future[Any], undo: Callable[[], object]) -> None:
    """Posted behind ``call`` (so it has ended): undo what it did only if it did it; one that
    raised (e.g. refused a request id a live request holds) did nothing to undo."""
    if not call.cancelled() and call.exception() is None:
        undo()


def _log_posted_error(future: Future[object]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("engine call queued without a caller failed", exc_info=future.exception())


def _ignore_error(error: BaseException) -> None:
    return None


class StepLoop:
    """Not started by the constructor: start ``thread`` once whatever ``poll`` uses exists."""

    def __init__(
        self,
        name: str,
        engine: EngineCore,
        on_outputs: Callable[[list[RequestOutput]], None],
        *,
        poll: Callable[[], None] = _nothing,
        has_work: Callable[[], bool] = _no_work,
        on_error: Callable[[BaseException], None] = _ignore_error,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self._poll = poll
        self._has_work = has_work
        self._on_outputs = on_outputs
        self._on_error = on_error
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._wake = threading.Event()
        # ``_closed`` and every put into ``_calls`` happen under ``_lock``: once closed, the
        # final drain sees every call that will ever be queued.
        self._lock = threading.Lock()
        self._closed = False
        self.error: BaseException | None = None
        self.num_waits = 0  # times the loop waited for a call or a wake-up
        self._interval_s = engine.config.min_step_interval_s
        self._clock = clock  # of pacing (a test holds it still)
        self._paced_until = 0.0  # the clock's time before which a decode-only step waits
        self.trace = StepTrace()  # appended on the loop thread: read it with `trace_snapshot`
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def is_closed(self) -> bool:
        return self._closed

    def wake(self) -> None:
        self._wake.set()

    def call(
        self,
        function: Callable[[], T],
        timeout: float = 60.0,
        *,
        undo: Callable[[], object] | None = None,
    ) -> T:
        """Run ``function`` on the loop thread; raises `EngineClosedError` once closed, and
        `EngineCallTimeoutError` after ``timeout`` seconds (see its ``started``). ``undo``:
        queued to run after a ``function`` that timed out once started (e.g. abort the request
        it starts), so that nothing it did outlives a caller that gave up."""
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise self._closed_error()
            self._calls.put((function, future))
        self._wake.set()
        try:
            return future.result(timeout)
        except TimeoutError:
            if future.cancel():  # not started: `_run_calls` will skip it
                raise EngineCallTimeoutError(
                    f"engine call not run within {timeout} s; cancelled, it will not run",
                    started=False,
                ) from None
            if future.done():  # it finished just as the wait ran out
                return future.result()
            if undo is not None:
                self._post(partial(_undo_if_done, future, undo))
            raise EngineCallTimeoutError(
                f"engine call still running after {timeout} s; it will complete unseen",
                started=True,
            ) from None

    def _post(self, function: Callable[[], object]) -> None:
        """Queue ``function`` without waiting for it; an error it raises is logged."""
        future: Future[object] = Future()
        future.add_done_callback(_log_posted_error)
        with self._lock:
            if self._closed:
                return  # the loop's end fails every request anyway
            self._calls.put((function, future))
        self._wake.set()

    def trace_snapshot(self) -> dict[str, Any]:
        """The engine's recent steps (`StepTrace.snapshot`), read on the loop thread; with
        speculative decoding on, also its draft counters since the start under
        ``"speculative"`` (the form `orchestrator.sim.spec_profile` reads), from which the
        simulator takes the acceptance a traced run had."""

        def snapshot() -> dict[str, Any]:
            trace = self.trace.snapshot()
            spec = self._engine.config.speculative
            if spec is not None:
                stats = self._engine.stats
                trace["speculative"] = {
                    "method": spec.method,
                    "num_speculative_tokens": spec.num_speculative_tokens,
                    "num_draft_tokens": stats.num_draft_tokens,
                    "num_accepted_tokens_per_pos": list(stats.num_accepted_tokens_per_pos),
                }
            return trace

        return self.call(snapshot)

    def stop(self, timeout: float = 30.0) -> None:
        with self._lock:
            self._closed = True
        self._wake.set()
        if not self.thread.is_alive():
            # Never started (or already ended): nobody else will answer what is queued.
            self._fail_calls(self._closed_error())
        elif threading.current_thread() is not self.thread:
            self.thread.join(timeout)

    def _run(self) -> None:
        try:
            while not self._closed:
                self._run_calls()
                self._poll()
                paced_s = 0.0  # how long a paced decode-only step has yet to wait
                if self._engine.has_unfinished():
                    early_s = self._paced_until - self._clock()
                    if early_s > 0 and not self._engine.has_prompt_work():
                        paced_s = min(early_s, _BUSY_WAIT_S)
                    elif self._step():
                        continue
                self.num_waits += 1
                self.trace.mark_wait()
                self._wake.wait(paced_s or (_BUSY_WAIT_S if self._has_work() else _IDLE_WAIT_S))
                self._wake.clear()
        except BaseException as error:  # reported to callers through call() and health
            log.exception("engine step loop failed")
            self.error = error
        finally:
            with self._lock:
                self._closed = True
            if self.error is None:
                self._run_calls()
            else:
                self._fail_calls(self._closed_error())
                self._report(self.error)

    def _step(self) -> bool:
        """One engine step; whether it did anything (ran the model, preempted or output)."""
        stats = self._engine.stats
        before = (stats.num_steps, stats.num_preemptions)
        paced_from = self._clock()
        start = time.perf_counter()
        outputs = self._engine.step()
        self._on_outputs(outputs)
        shape = self._engine.last_step_shape
        if stats.num_steps != before[0]:
            self._paced_until = paced_from + self._interval_s
            if shape is not None:
                self.trace.record(start, time.perf_counter() - start, shape)
        return bool(outputs) or (stats.num_steps, stats.num_preemptions) != before

    def _report(self, error: BaseException) -> None:
        try:
            self._on_error(error)
        except Exception:
            log.exception("on_error hook of the engine step loop failed")

    def _closed_error(self) -> EngineClosedError:
        if self.error is None:
            return EngineClosedError("engine step loop stopped")
        closed = EngineClosedError(f"engine step loop died: {self.error!r}")
        closed.__cause__ = self.error
        return closed

    def _run_calls(self) -> None:
        while True:
            try:
                function, future = self._calls.get_nowait()
            except queue.Empty:
                return
            # False when its caller timed out and cancelled it; once True, cancel() fails.
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(function())
            except BaseException as error:
                future.set_exception(error)

    def _fail_calls(self, error: EngineClosedError) -> None:
        while True:
            try:
                _, future = self._calls.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():  # a cancelled one takes no exception
                future.set_exception(error)
