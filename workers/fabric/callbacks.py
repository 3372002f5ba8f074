"""The callback thread: where every user callback of an engine runs.

The progress thread runs no user code. It hands `(callback, args)` to this thread through a
FIFO, so a slow or blocking callback delays only later callbacks, never polling (a stalled
poller would stall every peer's transfers, and on `tcp` the target's own incoming writes).
The one exception is an `Inline` callback: `submit_all` runs it at once on the submitting
thread. It is for callbacks that only hand the event on (a queue put, an event set) and never
block; the decode messenger's "KV arrived" (``expect_imm(..., inline=True)``) saves the hop to
this thread that way, ~75 us per transfer on the bench machine.
Callbacks of one engine run one at a time, in the order their events were observed (messages
from one peer therefore arrive in submission order). Exceptions are logged and counted.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from workers.fabric.errors import EngineClosedError

log = logging.getLogger(__name__)

Fire = tuple[Callable[..., None], tuple[object, ...]]


@dataclass(frozen=True)
class Inline:
    """A callback that `CallbackDispatcher.submit_all` runs on the submitting thread."""

    callback: Callable[[], None]

    def __call__(self) -> None:
        self.callback()


class CallbackDispatcher:
    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Fire | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self.errors = 0
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, callback: Callable[..., None], *args: object) -> None:
        """Queue a callback; raises `EngineClosedError` once closed (it would never run)."""
        with self._lock:
            if self._closed:
                raise EngineClosedError("engine is closed")
            self._queue.put((callback, args))

    def submit_all(self, fires: Iterable[Fire]) -> None:
        """Queue the fires in order; an `Inline` one runs here and now instead."""
        queued: list[Fire] = []
        for callback, args in fires:
            if not isinstance(callback, Inline):
                queued.append((callback, args))
                continue
            try:
                callback(*args)
            except Exception:  # never into the caller (the progress loop)
                self.errors += 1
                log.exception("inline fabric callback %r raised", callback.callback)
        if not queued:
            return  # nothing owed: a loop ending after its engine was torn down may call this
        with self._lock:
            if self._closed:
                raise EngineClosedError("engine is closed")
            for fire in queued:
                self._queue.put(fire)

    def close(self, timeout: float | None = None) -> None:
        """Run what is queued, then stop. From a callback itself, stop without waiting."""
        with self._lock:
            self._closed = True
            self._queue.put(None)
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            callback, args = item
            try:
                callback(*args)
            except Exception:
                self.errors += 1
                log.exception("fabric callback %r raised", callback)
