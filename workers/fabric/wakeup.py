"""Waking the progress thread out of its CQ wait (`pd_wake`: the engine's eventfd).

The thread sets `sleeping` before its final look at the queues and clears it after the wait;
a submitter that queues after that look sees the flag and wakes it. Submissions made inside
`deferred()` wake it once, when the outermost block ends (`TransferEngine.wakes_deferred`).
Once the engine frees the endpoint (`detach`), a late wake does nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from workers.fabric._lib import lib

if TYPE_CHECKING:
    from workers.fabric._fabric_cffi import PdEngine


class Waker:
    def __init__(self, native: PdEngine) -> None:
        self._native = native
        self._detached = False
        # Held by a wake (from any thread) against `detach` freeing the engine under it.
        self._lock = threading.Lock()
        # Per submitting thread: inside `deferred`, and whether a wake is owed at its end.
        self._local = threading.local()
        self.sleeping = False  # set and cleared by the progress thread only

    def wake(self, deferrable: bool = False) -> None:
        """Wake the thread if it sleeps; ``deferrable`` wakes wait for the end of a
        `deferred` block of this thread."""
        if deferrable and getattr(self._local, "deferring", False):
            self._local.wake_due = True
            return
        if self.sleeping:
            with self._lock:
                if not self._detached:  # else released: nothing left to wake
                    lib.pd_wake(self._native)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        local = self._local
        outer = getattr(local, "deferring", False)
        local.deferring = True
        try:
            yield
        finally:
            local.deferring = outer
            if not outer and getattr(local, "wake_due", False):
                local.wake_due = False
                self.wake()

    def detach(self) -> None:
        """The engine is about to free the native endpoint: later wakes do nothing."""
        with self._lock:
            self._detached = True
