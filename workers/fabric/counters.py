"""Immediate-data counters: the target side's only proof that writes landed.

Every write posted with `imm` produces, on the target, one completion carrying `imm` as CQ data
(FI_REMOTE_CQ_DATA). `ImmCounters` turns that stream into "request complete" events. Semantics
(one `imm` value at a time; values are compared whole, up to the provider's `imm_bits`):

* **Arming.** `expect(imm, count, ...)` arms a counter. Arrivals that came earlier and were
  buffered count immediately; when arrivals reach `count` the counter fires `on_reached()`
  exactly once and is disarmed, leaving the value free. Arrivals beyond `count` (a surplus) are
  kept as buffered arrivals of the next arming of the same value. Arming a value that is already
  armed raises `ImmError`.
* **Early arrivals.** An arrival for a value that is neither armed nor cancelled is buffered
  (`unexpected`). At most `max_unexpected` distinct values are buffered; beyond that the oldest
  value's arrivals are dropped and counted in `overflow_dropped` (logged as a warning).
* **Cancelling.** `cancel(imm)` disarms without calling anything, discards buffered arrivals,
  and tombstones the value: later ("late") arrivals with it are ignored, counted in
  `late_dropped` and logged at debug level. A later `expect(imm, ...)` re-arms the value and
  lifts the tombstone; from then on arrivals count again, including stragglers of the cancelled
  transfer. That is why the KV messenger puts generation bits into `imm`: a reused request slot
  gets a new value, so a straggler always hits a tombstone (or, once the tombstone is evicted
  after `max_cancelled` newer cancellations, the unexpected buffer), never a live counter.
* **Arrivals.** `arrived(imm)` is the number of arrivals seen for the value since it was last
  armed (or first seen): counted while armed, buffered, or dropped late after a cancel, less
  those already taken. `take_arrivals(imm)` returns a disarmed value's arrivals not taken yet,
  zeroes them and (re)tombstones the value as the newest: a caller that watches a cancelled
  value keeps the running total itself, since tombstones are bounded (the KV messenger learns
  so when every write of an aborted transfer has landed).
* **Reset.** `reset(imm)` forgets a disarmed value's tombstone and buffered arrivals, for a
  value handed out anew once no write of its earlier use can land: otherwise its new writes
  that come before the arming would hit the old tombstone and be dropped as late.
* **Deadlines.** An armed counter may carry a deadline; when it passes the counter is cancelled
  (tombstoned as above) and `on_error(ImmTimeoutError)` is called.
* **Close.** Armed counters get `on_error(EngineClosedError)` (`fail_all`: the engine closed,
  was abandoned by its watchdog, or its progress thread died). From then on `expect` raises
  `EngineClosedError`: nothing would ever fire or expire a counter armed later.
* **Shared.** The engines of one rank's NICs share one instance (`workers.fabric.nics`), so a
  value counts the writes landing on any of them. Then `fail_all` from any of them closes it
  for all (`closed_reason`): a request whose writes may come through a lost NIC can never
  complete, so the rank stops counting rather than wait on it.

The class is thread-safe and never calls user code itself: it returns the callbacks to run so
the engine can hand them to its callback dispatcher (which runs an `Inline` one at once, on
the handing thread: `workers.fabric.callbacks`).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from workers.fabric.callbacks import Fire
from workers.fabric.errors import EngineClosedError, FabricError, ImmError, ImmTimeoutError

log = logging.getLogger(__name__)

ErrorCallback = Callable[[FabricError], None]


@dataclass
class _Armed:
    count: int
    arrived: int
    on_reached: Callable[[], None]
    on_error: ErrorCallback | None
    deadline: float | None


@dataclass(frozen=True)
class ImmStats:
    received: int
    fired: int
    armed: int
    unexpected_values: int
    late_dropped: int
    overflow_dropped: int
    timed_out: int


class ImmCounters:
    def __init__(self, max_unexpected: int = 65536, max_cancelled: int = 65536) -> None:
        self._lock = threading.Lock()
        self._armed: dict[int, _Armed] = {}
        self._unexpected: OrderedDict[int, int] = OrderedDict()
        # Tombstones: cancelled value -> arrivals seen for it (before and after the cancel).
        self._cancelled: OrderedDict[int, int] = OrderedDict()
        self._max_unexpected = max_unexpected
        self._max_cancelled = max_cancelled
        self._received = 0
        self._fired = 0
        self._late_dropped = 0
        self._overflow_dropped = 0
        self._timed_out = 0
        self._closed: FabricError | None = None  # set by `fail_all`: why nothing fires now

    def expect(
        self,
        imm: int,
        count: int,
        on_reached: Callable[[], None],
        on_error: ErrorCallback | None = None,
        deadline: float | None = None,
    ) -> list[Fire]:
        if count < 1:
            raise ImmError(f"expected count must be >= 1, got {count}")
        with self._lock:
            if self._closed is not None:
                raise EngineClosedError(f"cannot arm imm {imm:#x}: {self._closed}")
            if imm in self._armed:
                raise ImmError(f"immediate value {imm:#x} is already armed")
            self._cancelled.pop(imm, None)
            arrived = self._unexpected.pop(imm, 0)
            armed = _Armed(count, 0, on_reached, on_error, deadline)
            self._armed[imm] = armed
            return self._add(imm, armed, arrived)

    def cancel(self, imm: int) -> bool:
        """Disarm and tombstone `imm`; True if it was armed or had buffered arrivals."""
        with self._lock:
            armed = self._armed.pop(imm, None)
            buffered = self._unexpected.pop(imm, None)
            arrived = (armed.arrived if armed is not None else 0) + (buffered or 0)
            self._tombstone(imm, arrived)
            return armed is not None or buffered is not None

    def reset(self, imm: int) -> None:
        """Forget the tombstone and buffered arrivals of the disarmed `imm` (handed out anew;
        the caller guarantees that no write of its earlier use can still land)."""
        with self._lock:
            if imm in self._armed:
                raise ImmError(f"cannot reset armed immediate value {imm:#x}")
            self._cancelled.pop(imm, None)
            self._unexpected.pop(imm, None)

    def take_arrivals(self, imm: int) -> int:
        """Arrivals of the disarmed `imm` not taken yet (tombstoned, or buffered once its
        tombstone was evicted); zeroes them and keeps `imm` tombstoned, as the newest."""
        with self._lock:
            if imm in self._armed:
                raise ImmError(f"cannot take the arrivals of armed immediate value {imm:#x}")
            taken = self._cancelled.pop(imm, 0) + self._unexpected.pop(imm, 0)
            self._tombstone(imm, 0)
            return taken

    def arrived(self, imm: int) -> int:
        """Arrivals of `imm` since it was last armed (armed, buffered or tombstoned), less
        those taken (`take_arrivals`)."""
        with self._lock:
            armed = self._armed.get(imm)
            if armed is not None:
                return armed.arrived
            if imm in self._cancelled:
                return self._cancelled[imm]
            return self._unexpected.get(imm, 0)

    def record(self, counts: Mapping[int, int]) -> list[Fire]:
        """Account a batch of arrivals ({imm: number of completions})."""
        fires: list[Fire] = []
        with self._lock:
            for imm, n in counts.items():
                self._received += n
                armed = self._armed.get(imm)
                if armed is not None:
                    fires.extend(self._add(imm, armed, n))
                elif imm in self._cancelled:
                    self._cancelled[imm] += n
                    self._late_dropped += n
                    log.debug("ignored %d late write(s) with cancelled imm %#x", n, imm)
                else:
                    self._buffer(imm, n)
        return fires

    def expire(self, now: float) -> list[Fire]:
        fires: list[Fire] = []
        with self._lock:
            late = [
                i for i, a in self._armed.items() if a.deadline is not None and a.deadline <= now
            ]
            for imm in late:
                armed = self._armed.pop(imm)
                self._tombstone(imm, armed.arrived)
                self._timed_out += 1
                if armed.on_error is not None:
                    error = ImmTimeoutError(
                        f"imm {imm:#x}: {armed.arrived} of {armed.count} writes arrived in time"
                    )
                    fires.append((armed.on_error, (error,)))
        return fires

    def fail_all(self, error: FabricError) -> list[Fire]:
        """Fail every armed counter with ``error`` and refuse later arming (closed)."""
        with self._lock:
            if self._closed is None:
                self._closed = error
            armed = list(self._armed.values())
            self._armed.clear()
        return [(a.on_error, (error,)) for a in armed if a.on_error is not None]

    def closed_reason(self) -> str | None:
        """Why nothing fires any more (`fail_all` was called), None while counting."""
        with self._lock:
            return None if self._closed is None else str(self._closed)

    def next_deadline(self) -> float | None:
        with self._lock:
            deadlines = [a.deadline for a in self._armed.values() if a.deadline is not None]
        return min(deadlines) if deadlines else None

    def stats(self) -> ImmStats:
        with self._lock:
            return ImmStats(
                received=self._received,
                fired=self._fired,
                armed=len(self._armed),
                unexpected_values=len(self._unexpected),
                late_dropped=self._late_dropped,
                overflow_dropped=self._overflow_dropped,
                timed_out=self._timed_out,
            )

    # -- under the lock ---------------------------------------------------------------------

    def _add(self, imm: int, armed: _Armed, n: int) -> list[Fire]:
        armed.arrived += n
        if armed.arrived < armed.count:
            return []
        del self._armed[imm]
        self._fired += 1
        surplus = armed.arrived - armed.count
        if surplus:
            self._buffer(imm, surplus)
        return [(armed.on_reached, ())]

    def _buffer(self, imm: int, n: int) -> None:
        self._unexpected[imm] = self._unexpected.get(imm, 0) + n
        while len(self._unexpected) > self._max_unexpected:
            old_imm, old_n = self._unexpected.popitem(last=False)
            self._overflow_dropped += old_n
            log.warning("dropped %d unexpected write(s) with imm %#x (buffer full)", old_n, old_imm)

    def _tombstone(self, imm: int, arrived: int) -> None:
        self._cancelled[imm] = arrived
        self._cancelled.move_to_end(imm)
        while len(self._cancelled) > self._max_cancelled:
            self._cancelled.popitem(last=False)
