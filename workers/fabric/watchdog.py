"""The stall watchdog: a thread that notices when one provider call has not returned.

The progress thread cannot notice that it is itself stuck inside libfabric (shm: a post that
spins forever on the lock of a peer killed while holding it; any other provider call that never
returns), and no deadline can fire while it is: it is the thread that checks them. So a second
thread watches it. It is its own module because it only detects: what abandoning the engine
means (which jobs end with which error, what is refused) acts on the progress loop's locked
state, so the loop hands that in as `on_stall`.

Contract with the watched thread, through `probe` (`ProgressLoop.native_call`): it returns the
start (`time.monotonic()`) of the native call in progress and the peer it posts to (None: the
CQ poll), or 0.0 when no call is in progress. A call judged stuck has not returned for
`_STALL_S`, seen on two consecutive looks `_WATCHDOG_PERIOD_S` apart: the second look lets a
thread that has returned but merely waits for the GIL note its return first. `on_stall(peer,
stalled_s)` runs once, on this thread, which then ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from workers.fabric.handles import PeerHandle

# A post or poll call that has not returned after this long is stuck inside the provider.
_STALL_S = 3.0
_WATCHDOG_PERIOD_S = 0.25
# Longest single CQ wait or spin (`idle_wait_us`, `spin_us`): a third of the 3 s above, which
# would take a longer one for a provider call stuck and abandon an idle engine.
MAX_POLL_US = 1_000_000


class Watchdog:
    """Calls `on_stall` once if one native call of the watched thread stays in progress."""

    def __init__(
        self,
        *,
        name: str,
        probe: Callable[[], tuple[float, PeerHandle | None]],
        on_stall: Callable[[PeerHandle | None, float], None],
    ) -> None:
        self._probe = probe
        self._on_stall = on_stall
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """End the thread and wait for it: what `on_stall` delivers is queued when this returns."""
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join()

    def _watch(self) -> None:
        suspect = 0.0
        while not self._stop.wait(_WATCHDOG_PERIOD_S):
            since, peer = self._probe()
            if not (since and time.monotonic() - since > _STALL_S):
                suspect = 0.0
            elif suspect != since:
                # Seen once: wait a period (without the GIL) so a thread that merely waited
                # for the GIL to note its return gets to do so before we judge it stuck.
                suspect = since
            else:
                self._on_stall(peer, time.monotonic() - since)
                return


def check_poll_waits(spin_us: int, idle_wait_us: int | None) -> None:
    """Refuse CQ spins and waits that this watchdog would take for a stuck call."""
    for name, value in (("spin_us", spin_us), ("idle_wait_us", idle_wait_us)):
        if value is not None and not 0 <= value <= MAX_POLL_US:
            raise ValueError(
                f"{name}={value} must be in [0, {MAX_POLL_US}]: one wait longer than that "
                f"looks like a stuck provider call to the watchdog, which abandons the engine"
            )
