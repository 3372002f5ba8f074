"""The CQ drain of the progress loop: `pd_poll`'s rows turned into job completions, counter
arrivals, received messages and error completions.

`pd_poll` merges runs of identical completions (one job's, or one imm value's) into one row,
so this loops per row, not per completion. Callbacks are queued in CQ order: imm arrivals are
handed to the counters before any later row of the same drain (a message, a local completion)
is dispatched. An error completion that names a connection error fails the job's peer.

The CQ wait fd can stay readable with nothing to read: libfabric 1.17's tcp provider keeps a
connection that closed before its handshake (a bare connect and close, as a port scanner or a
TCP health check makes) in its poll set, so every wait returns at once and the idle thread
spins a core for good. `read` notices waits that keep returning early and empty
(`_STORM_WAITS` of them over `_STORM_S`) and stops waiting on the fd (`pd_engine_drop_wait_fd`):
waits become timed naps (`NAP_WAIT_US`), as for a provider without a wait fd.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from workers.fabric._lib import ffi, lib, strerror
from workers.fabric.callbacks import CallbackDispatcher
from workers.fabric.counters import ImmCounters
from workers.fabric.errors import FabricError, PeerFailedError, TransferError
from workers.fabric.jobs import WRITE, ProgressStats
from workers.fabric.ledger import JobLedger
from workers.fabric.messages import MessagePools
from workers.fabric.peers import PeerTable

if TYPE_CHECKING:
    from workers.fabric._fabric_cffi import PdEngine

log = logging.getLogger(__name__)

_POLL_ROWS = 256
# An idle wait without a CQ fd: a timed nap, woken early only by the engine's own eventfd.
NAP_WAIT_US = 200
# Waits that returned early with nothing read, one after another, over at least this long:
# the fd is readable for good (a legitimate wake reads something, or is the eventfd's).
_STORM_WAITS = 10_000
_STORM_S = 1.0
# errno values that mean the connection to the peer is gone, not that one operation was bad.
_CONNECTION_ERRORS = {32, 103, 104, 107, 110, 111, 112, 113}  # EPIPE ECONNABORTED ... EHOSTUNREACH


class CompletionDrain:
    """Reads one endpoint's CQ for its `ProgressLoop` (progress thread only)."""

    def __init__(
        self,
        native: PdEngine,
        *,
        ledger: JobLedger,
        peers: PeerTable,
        counters: ImmCounters,
        dispatcher: CallbackDispatcher,
        pools: MessagePools,
        stats: ProgressStats,
        on_wait_fd_dropped: Callable[[], None],
    ) -> None:
        """``on_wait_fd_dropped``: called once, on the progress thread, when waits become naps."""
        self._native = native
        self._on_wait_fd_dropped = on_wait_fd_dropped
        self._ledger = ledger
        self._peers = peers
        self._counters = counters
        self._dispatcher = dispatcher
        self._pools = pools
        self._stats = stats
        self._rows = [ffi.new("uint64_t[]", _POLL_ROWS) for _ in range(4)]
        self._error = ffi.new("pd_error_t *")
        self._waits_on_fd = lib.pd_engine_wait_fd(native) >= 0
        self._empty_waits = 0  # early, empty waits in a row
        self._empty_since = 0.0

    def read(self, spin_us: int, wait_us: int) -> int:
        """The native call: drain the CQ into the row arrays, spinning and then waiting for
        at most the given times when it is empty. Its result goes to `dispatch`."""
        kinds, ids, data, lens = self._rows
        watch = wait_us > 0 and self._waits_on_fd  # not on the spinning path
        began = time.monotonic() if watch else 0.0
        n = lib.pd_poll(
            self._native, _POLL_ROWS, kinds, ids, data, lens, spin_us, wait_us, self._error
        )
        if watch:
            now = time.monotonic()
            # Early: well before both the spin and the wait could have run out.
            if n == 0 and now - began < (spin_us + wait_us) / 2e6:
                self._note_empty_wait(now)
            else:
                self._empty_waits = 0
        return n

    def _note_empty_wait(self, now: float) -> None:
        if self._empty_waits == 0:
            self._empty_since = now
        self._empty_waits += 1
        if self._empty_waits >= _STORM_WAITS and now - self._empty_since >= _STORM_S:
            lib.pd_engine_drop_wait_fd(self._native)
            self._waits_on_fd = False
            self._stats.wait_fd_dropped = True
            self._on_wait_fd_dropped()
            log.warning(
                "the CQ wait fd stayed readable with nothing to read (%d waits in %.1f s; "
                "a connection to this endpoint closed before its handshake?): idle waits are "
                "%d us naps from now on",
                self._empty_waits,
                now - self._empty_since,
                NAP_WAIT_US,
            )

    def dispatch(self, n: int) -> bool:
        """Act on what `read` returned; True if it read anything."""
        kinds, ids, data, lens = self._rows
        error = n <= lib.PD_POLL_ERROR
        rows = lib.PD_POLL_ERROR - n if error else n
        if rows < 0:
            raise FabricError(f"reading the completion queue failed: {strerror(rows)} ({rows})")
        imm_counts: dict[int, int] = {}
        for row in range(rows):
            kind = kinds[row]
            if kind == lib.PD_EV_LOCAL or kind == lib.PD_EV_RECV:
                if imm_counts:
                    # Callbacks follow the CQ's order: writes that landed before this row
                    # fire their counters before its callback is queued.
                    self._record(imm_counts)
                    imm_counts = {}
                if kind == lib.PD_EV_LOCAL:
                    self._ledger.completed(ids[row], lens[row])
                else:
                    self._received(ids[row], lens[row])
            else:
                imm_counts[data[row]] = imm_counts.get(data[row], 0) + lens[row]
                if kind == lib.PD_EV_IMM_RECV:
                    self._pools.repost_receive(self._native, ids[row])
        if imm_counts:
            self._record(imm_counts)
        if error:
            self._error_completion()
        return rows > 0 or error

    def _record(self, imm_counts: dict[int, int]) -> None:
        self._stats.imm_writes_received += sum(imm_counts.values())
        self._dispatcher.submit_all(self._counters.record(imm_counts))

    def _received(self, slot_id: int, length: int) -> None:
        if self._pools.deliver(self._native, slot_id, length, self._dispatcher):
            self._stats.messages_received += 1
        else:
            self._stats.messages_malformed += 1

    def _error_completion(self) -> None:
        error = self._error
        self._stats.error_completions += 1
        text = ffi.string(error.msg).decode(errors="replace")
        job = self._ledger.jobs.get(error.id)
        if job is None:
            if self._pools.is_receive(error.id):
                self._pools.repost_receive(self._native, error.id)
            log.warning("error completion without a live operation: %s (err %d)", text, error.err)
            return
        self._ledger.failed_op(job)
        what = "write" if job.kind == WRITE else "message"
        exc: FabricError = TransferError(
            f"{what} to {job.peer.name} failed: {text} "
            f"(err {error.err}: {strerror(error.err)}, provider errno {error.prov_errno})",
            error.err,
            error.prov_errno,
        )
        # rxm/tcp reports a dropped connection as FI_ECANCELED with the socket errno as the
        # provider errno; either side naming a connection error means the peer is gone.
        if error.err in _CONNECTION_ERRORS or abs(error.prov_errno) in _CONNECTION_ERRORS:
            self._peers.fail(job.peer, PeerFailedError(str(exc)))
        self._ledger.finish(job, exc)
