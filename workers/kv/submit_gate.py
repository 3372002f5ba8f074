"""Where the prefill side's writes are counted: the push thread and the context write ask here
before they submit, and report here what the fabric never posted.

A write is counted as submitted (under the transfers' lock) before it is posted, and only while
its transfer accepts writes and before its deadline: an abort acknowledged at any moment never
undercounts. Writes the fabric refuses at once (queue full, peer failed, engine closed), or
accepted but never posted (`workers.kv.push.CallOutcome`), are taken back out of the count at
once, before any count is reported (an acknowledgement naming writes that never come would hold
the decoder's quarantine forever); the step thread then gives the transfer up
(`PrefillMessenger._handle_not_posted`, fed by `SubmitGate.not_posted_events`).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable

from workers.fabric import FabricError
from workers.kv.errors import KvTransferError
from workers.kv.outgoing import Outgoing
from workers.kv.prefill_table import PrefillTable
from workers.kv.push import PushItem

log = logging.getLogger(__name__)


class SubmitGate:
    def __init__(self, table: PrefillTable, wake: Callable[[], None]) -> None:
        """``wake``: wakes the thread that polls `not_posted_events`."""
        self._table = table
        self._wake = wake
        # (request id, imm, why) of writes taken back out of their transfer's count.
        self.not_posted_events: queue.SimpleQueue[tuple[str, int, FabricError]] = (
            queue.SimpleQueue()
        )

    def gate(self, item: PushItem, layer: int) -> bool:
        """Push thread: may ``item``'s writes of ``layer`` go? Counted as submitted if so."""
        with self._table.lock:
            out = self._table.live(item.request_id, item.imm)
            if out is None or not out.transfer.accepts_writes:
                return False
            now = time.monotonic()
            if now >= out.deadline_s:
                return False  # a prefill worker never submits after the deadline
            try:
                out.transfer.record_submit(item.num_bytes, now, count=item.num_writes)
            except KvTransferError:
                log.exception("transfer %s: write plan exceeded", item.request_id)
                return False
            return True

    def item_not_posted(
        self, item: PushItem, count: int, num_bytes: int, error: FabricError
    ) -> None:
        """Push thread (or the step thread in `PushThread.pass_ended`): gated writes the fabric
        refused at once."""
        with self._table.lock:
            out = self._table.live(item.request_id, item.imm)
            # Still live: a transfer ends only with nothing in flight, these writes included.
            if out is not None:
                self.not_posted(out, count, num_bytes, error)

    def context_not_posted(
        self, out: Outgoing, count: int, num_bytes: int, error: FabricError
    ) -> None:
        """Callback thread: the context write was accepted but never posted (`CallOutcome`)."""
        with self._table.lock:
            if self._table.by_id.get(out.request_id) is out:  # still live: it was in flight
                self.not_posted(out, count, num_bytes, error)

    def not_posted(self, out: Outgoing, count: int, num_bytes: int, error: FabricError) -> None:
        """Under the lock: take writes recorded as submitted but never posted back out of the
        count, and tell the step thread."""
        log.warning("transfer %s: %d writes not posted: %s", out.request_id, count, error)
        out.transfer.unrecord_submit(num_bytes, count)
        self.not_posted_events.put((out.request_id, out.transfer.imm, error))
        self._wake()
