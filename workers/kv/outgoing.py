"""One prefill-side transfer: its accepted request, its state machine and its pages so far.

`Outgoing.plan_chunk` turns one scheduled chunk into the `PushItem` of the pages it makes
sendable (`workers.kv.pages.sendable_pages`: whole segments, or the rest after the last chunk)
and, at the last chunk, fixes the exact write count: only then are all source page ids, and so
the coalesced runs, known. Pages the decoder holds (`PrefillRequest.skip_pages`) are computed
(or found in this worker's prefix cache) but never written: ``src_pages`` and every page index
here start after them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workers.engine.scheduler import ScheduledChunk
from workers.fabric import PeerHandle
from workers.kv.checksum import ChecksumAccumulator
from workers.kv.nic_lanes import Lane
from workers.kv.pages import num_pages_for_tokens, sendable_pages
from workers.kv.prefill_checks import CheckedRequest
from workers.kv.protocol import PrefillAccepted, PrefillRequest
from workers.kv.push import PushItem, build_push_item
from workers.kv.transfer_state import PrefillState, PrefillTransfer
from workers.kv.writes import PoolLayout, expected_write_count

# A transfer that may still submit writes (or is waiting to): deadlines, aborts and giving up
# stop it; any other one is draining or ended.
ACTIVE = (PrefillState.QUEUED, PrefillState.PREFILLING, PrefillState.WRITING)


@dataclass
class Outgoing:
    checked: CheckedRequest
    peer: PeerHandle  # the decoder's primary NIC: control messages and the context write
    lane: Lane  # the NIC pair its page writes go through (`workers.kv.nic_lanes`)
    transfer: PrefillTransfer
    deadline_s: float
    num_pages_total: int
    context_row: int
    src_pages: list[int] = field(default_factory=list)  # the engine's, from skip_pages on
    num_pages_sent: int = 0
    in_engine: bool = False
    prefilled: bool = False
    # Checksum mode: the request's sums; the context write goes once both are true.
    checksums: ChecksumAccumulator | None = None
    context_staged: bool = False  # hidden state copied into the staging row
    context_sent: bool = False

    @property
    def skip_pages(self) -> int:
        """The prompt's leading pages the decoder holds: computed here, never written."""
        return self.checked.request.skip_pages

    @property
    def num_engine_pages(self) -> int:
        """Pages the engine holds for the request: its whole prompt's, skipped ones included."""
        return self.num_pages_total + self.skip_pages

    @property
    def request(self) -> PrefillRequest:
        return self.checked.request

    @property
    def request_id(self) -> str:
        return self.checked.request.request_id

    @property
    def active(self) -> bool:
        return self.transfer.state in ACTIVE

    def plan_chunk(
        self, chunk: ScheduledChunk, src_layout: PoolLayout
    ) -> tuple[PushItem | None, PrefillAccepted | None]:
        """The writes this chunk makes sendable, and the acceptance once the count is known."""
        plan = self.checked.plan
        accepted = None
        if chunk.end == len(self.request.token_ids):
            planned = expected_write_count(
                plan,
                self.src_pages,
                self.checked.dst_pages,
                plan.geometry.num_layers,
                self.request.num_context_writes,
            )
            self.transfer.set_planned(planned)
            accepted = PrefillAccepted(self.request_id, self.transfer.imm, planned)
        # Pages are counted from the first one written (the decoder's cached ones skipped),
        # here and on the decoder, so runs and segments agree whatever the skip.
        done = num_pages_for_tokens(chunk.end, plan.geometry.page_size) - self.skip_pages
        done = max(done, 0)
        pages = sendable_pages(done, self.num_pages_total, self.num_pages_sent, plan.segment_pages)
        if not pages:
            return None, accepted
        self.num_pages_sent = pages.stop
        lane = self.lane
        item = build_push_item(
            self.request_id,
            self.transfer.imm,
            lane.peer,
            lane.dst_descriptors,
            plan,
            self.src_pages[pages.start : pages.stop],
            self.checked.dst_slice(pages),
            src_layout,
            self.checked.dst_layout,
            pages.start,
            self.checksums,
            lane.nic,
        )
        return item, accepted

    def summary(self) -> dict[str, Any]:
        """Plain-data record of the ended transfer (kept for late aborts and measurements)."""
        stats = self.transfer.stats
        return {
            "imm": self.transfer.imm,
            "state": self.transfer.state.value,
            "reason": self.transfer.failure_reason,
            "num_writes": self.transfer.num_writes_submitted,
            "num_writes_planned": self.transfer.num_writes_planned,
            "num_bytes": stats.num_bytes,
            "first_submit_s": stats.first_submit_s,
            "last_submit_s": stats.last_submit_s,
            "last_completion_s": stats.last_completion_s,
            "prefill_start_s": self.transfer.entered_at(PrefillState.PREFILLING),
            "forward_end_s": stats.forward_end_s,
            "src_pages": list(self.src_pages),
        }
