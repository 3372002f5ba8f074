"""The one thread that drives an `EngineCore` (the engine is not thread-safe).

    loop: run shipped calls ─▶ poll() ─▶ engine.step() (if work) ─▶ on_outputs(outputs)
          (idle: wait until a call or ``wake()``; shorter waits while ``has_work()``)

Other threads reach the engine only through ``call(function)``, which runs ``function`` on this
thread and returns its result. Used by the KV workers (``poll`` / ``has_work`` drive the
messenger) and by the colocated worker backend (no messenger).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

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
    ) -> None:
        self._engine = engine
        self._poll = poll
        self._has_work = has_work
        self._on_outputs = on_outputs
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopped = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def wake(self) -> None:
        self._wake.set()

    def call(self, function: Callable[[], T], timeout: float = 60.0) -> T:
        if self.error is not None:
            raise RuntimeError(f"engine step loop died: {self.error!r}")
        future: Future[T] = Future()
        self._calls.put((function, future))
        self._wake.set()
        return future.result(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        self._stopped = True
        self._wake.set()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout)

    def _run(self) -> None:
        try:
            while not self._stopped:
                self._run_calls()
                self._poll()
                if self._engine.has_unfinished():
                    self._on_outputs(self._engine.step())
                    continue
                self._wake.wait(_BUSY_WAIT_S if self._has_work() else _IDLE_WAIT_S)
                self._wake.clear()
        except BaseException as error:  # reported to callers through call() and health
            log.exception("engine step loop failed")
            self.error = error
        finally:
            self._run_calls()

    def _run_calls(self) -> None:
        while True:
            try:
                function, future = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                future.set_result(function())
            except BaseException as error:
                future.set_exception(error)
