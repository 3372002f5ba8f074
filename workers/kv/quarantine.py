"""Pages of a failed or aborted transfer are not reused until no write can still land in them.

A prefill worker may have writes in flight when the decoder gives up on a transfer (deadline,
rejection, abort). If the decoder handed those pages to another request, a late write would
silently corrupt that request's KV. So the decoder *quarantines* the pages and returns them to
its pool only when one of these holds (checked in this order):

1. **All counted**: every expected write of the transfer arrived (counted under its old imm,
   which the slot table now reports as stale). Nothing is left to land.
2. **Acknowledged**: the prefill side answered the abort with the number of writes it ever
   submitted (`AbortAcknowledged`), it submits none afterwards, and that many have arrived.
3. **Drained by time**: ``drain_interval_s`` passed after ``max(abort time, transfer deadline)``.
   A prefill worker never submits a write after the transfer's deadline, so this bounds how late
   a write can land even when the prefill worker is dead or unreachable.

Target-side arrivals are the only proof of delivery (an initiator completion over ``tcp`` only
means the bytes left the socket), hence rules 1-2 count arrivals and never trust completions.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuarantinedPages:
    imm: int
    request_id: str
    page_ids: tuple[int, ...]


@dataclass
class _Entry:
    pages: QuarantinedPages
    num_writes_expected: int
    num_writes_seen: int
    release_at_s: float
    num_writes_submitted: int | None = None  # from the prefill side's abort acknowledgement

    def drained(self, now_s: float) -> bool:
        if self.num_writes_seen >= self.num_writes_expected:
            return True
        submitted = self.num_writes_submitted
        if submitted is not None and self.num_writes_seen >= submitted:
            return True
        return now_s >= self.release_at_s


class PageQuarantine:
    """Bookkeeping of quarantined pages by imm; the messenger drives it and frees what it
    returns. Every method returns the entries released by that call."""

    def __init__(self, drain_interval_s: float) -> None:
        if drain_interval_s < 0:
            raise ValueError(f"drain_interval_s must be >= 0, got {drain_interval_s}")
        self.drain_interval_s = drain_interval_s
        self._entries: dict[int, _Entry] = {}

    def hold(
        self,
        pages: QuarantinedPages,
        *,
        num_writes_expected: int,
        num_writes_seen: int,
        now_s: float,
        deadline_s: float,
    ) -> list[QuarantinedPages]:
        """Quarantine the pages of a transfer that ended without becoming ready."""
        if pages.imm in self._entries:
            raise ValueError(f"imm {pages.imm:#x} is already quarantined")
        if num_writes_seen < 0 or num_writes_expected < 0:
            raise ValueError("write counts must be >= 0")
        release_at = max(now_s, deadline_s) + self.drain_interval_s
        self._entries[pages.imm] = _Entry(pages, num_writes_expected, num_writes_seen, release_at)
        return self._release_if_drained(pages.imm, now_s)

    def record_writes(self, imm: int, count: int, now_s: float) -> list[QuarantinedPages]:
        """Count writes that arrived for a stale imm (ignored when it is not quarantined)."""
        entry = self._entries.get(imm)
        if entry is None:
            return []
        entry.num_writes_seen += count
        return self._release_if_drained(imm, now_s)

    def acknowledge_abort(
        self, imm: int, num_writes_submitted: int, now_s: float
    ) -> list[QuarantinedPages]:
        entry = self._entries.get(imm)
        if entry is None:
            return []
        if num_writes_submitted < 0:
            raise ValueError(f"num_writes_submitted must be >= 0, got {num_writes_submitted}")
        entry.num_writes_submitted = num_writes_submitted
        return self._release_if_drained(imm, now_s)

    def expire(self, now_s: float) -> list[QuarantinedPages]:
        """Release every entry whose drain interval passed (call from the messenger loop)."""
        drained = [imm for imm, entry in self._entries.items() if entry.drained(now_s)]
        return [self._entries.pop(imm).pages for imm in drained]

    @property
    def num_pages(self) -> int:
        return sum(len(entry.pages.page_ids) for entry in self._entries.values())

    def __contains__(self, imm: object) -> bool:
        return imm in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _release_if_drained(self, imm: int, now_s: float) -> list[QuarantinedPages]:
        if self._entries[imm].drained(now_s):
            return [self._entries.pop(imm).pages]
        return []
