"""How an engine ends: `TransferEngine.close`, which may not be able to wait for its progress
thread, and the teardown that then falls to that thread.

`close` stops the loop and waits for its thread, then stops the callback thread once what is
queued ran, and frees the endpoint. Where it cannot wait (called on the progress thread itself,
from an inline callback, or that thread is still inside a provider call after ``timeout``) it
returns, and the loop completes the teardown as its work ends (`loop_ended`: on its thread, or
on the watchdog's for an abandoned loop); a later `close` waits again. An abandoned loop's
endpoint is never freed: its stuck call may return some day.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from workers.fabric.callbacks import CallbackDispatcher
from workers.fabric.progress import ProgressLoop

log = logging.getLogger(__name__)


class EngineClosing:
    def __init__(
        self, loop: ProgressLoop, dispatcher: CallbackDispatcher, release: Callable[[], None]
    ) -> None:
        self._loop = loop
        self._dispatcher = dispatcher
        self._release = release  # frees the regions and the endpoint
        self._lock = threading.Lock()
        self._released = False  # teardown done: the endpoint is freed (or left to leak)
        self._owed = False  # `close` could not wait: the loop tears down as it ends

    def close(self, timeout: float) -> None:
        """Stop the loop, and tear down now or leave it owed to the loop (module docstring)."""
        loop = self._loop
        loop.stop()
        on_loop = threading.current_thread() is loop.thread
        if not on_loop:
            loop.thread.join(timeout)
        with self._lock:
            if not loop.work_ended:
                self._owed = True  # `loop_ended` reads it under this lock
                if not on_loop:
                    log.error(
                        "fabric progress thread did not stop within %.3g s; it completes the "
                        "teardown when it does", timeout,
                    )  # fmt: skip
                return
        self._teardown(timeout)

    def loop_ended(self) -> None:
        """The loop's work is over (its thread, or the watchdog's once it abandoned the
        loop): complete a `close` that could not wait for it."""
        with self._lock:
            owed, self._owed = self._owed, False
        if owed:
            # Never wait here for the callback thread: a callback may be waiting for us.
            self._teardown(0.0)

    def _teardown(self, timeout: float) -> None:
        """Stop the callback thread once what is queued ran, then free the endpoint."""
        self._dispatcher.close(timeout)  # again on a later close: waits for the thread
        with self._lock:
            if self._released:
                return
            self._released = True
            if self._loop.abandoned:
                # Its stuck call may return some day. Nothing polled it since, while peers
                # went on writing: closing such an endpoint crashed tcp;ofi_rxm (libfabric
                # 1.17) in tests.
                log.error("fabric engine was abandoned; leaking its endpoint")
                return
            self._release()
