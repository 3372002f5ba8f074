"""Pages of a failed or aborted transfer are not reused while a write can still land in them.

A prefill worker may have writes in flight when the decoder gives up on a transfer (deadline,
rejection, abort), and a prefill process that is paused (SIGSTOP), descheduled, swapped out or
stalled in a GC may post or transmit a write long after any deadline: time bounds nothing. If
the decoder handed those pages to another request, a late write would silently corrupt that
request's KV. So the decoder *quarantines* the pages and returns them to its pool only when one
of these holds (safety over capacity):

1. **All counted**: every expected write of the transfer arrived (counted under its old imm,
   which the slot table now reports as stale). Nothing is left to land.
2. **Acknowledged**: the prefill side answered the abort with the number of writes it ever
   submitted (`AbortAcknowledged`, or `PrefillFailed` / `PrefillRejected`), it submits none
   afterwards, and that many have arrived. Several answers keep the smallest count: each one
   bounds what can ever land.
3. **Peer gone**: the prefill process that could write is known gone (`peer_gone`): its fabric
   connection failed or its process exited (not a missed deadline: a stopped process misses
   those too), or nothing listens at its ``tcp`` address any more. An endpoint naming another
   incarnation is no proof (it may be a stale or unversioned one while the old process lives);
   a worker restarted at the address acknowledges the aborts it never saw with 0 instead (2).
   A transfer whose request never reached the prefill worker (its send failed, or it was
   rejected) is acknowledged with 0 writes too.

Until then the messenger re-sends `AbortPrefill` every ``resend_interval_s`` (`aborts_due`),
so a prefill worker that resumes acknowledges promptly and a dead one shows through its sends.
Time never releases pages by itself: a paused prefill keeps them quarantined (capacity, never
corruption) until it answers or the control plane replaces it.

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
    peer: bytes = b""  # fabric address of the prefill worker that may still write


@dataclass
class _Entry:
    pages: QuarantinedPages
    num_writes_expected: int
    num_writes_seen: int
    next_abort_s: float
    num_writes_submitted: int | None = None  # smallest count the prefill side acknowledged

    @property
    def drained(self) -> bool:
        if self.num_writes_seen >= self.num_writes_expected:
            return True
        submitted = self.num_writes_submitted
        return submitted is not None and self.num_writes_seen >= submitted


class PageQuarantine:
    """Bookkeeping of quarantined pages by imm; the messenger drives it and frees what it
    returns. Every method but `aborts_due` returns the entries released by that call."""

    def __init__(self, resend_interval_s: float) -> None:
        if resend_interval_s < 0:
            raise ValueError(f"resend_interval_s must be >= 0, got {resend_interval_s}")
        self.resend_interval_s = resend_interval_s
        self._entries: dict[int, _Entry] = {}

    def hold(
        self,
        pages: QuarantinedPages,
        *,
        num_writes_expected: int,
        num_writes_seen: int,
        now_s: float,
    ) -> list[QuarantinedPages]:
        """Quarantine the pages of a transfer that ended without becoming ready; its first
        `AbortPrefill` is due at once."""
        if pages.imm in self._entries:
            raise ValueError(f"imm {pages.imm:#x} is already quarantined")
        if num_writes_seen < 0 or num_writes_expected < 0:
            raise ValueError("write counts must be >= 0")
        self._entries[pages.imm] = _Entry(pages, num_writes_expected, num_writes_seen, now_s)
        return self._release_if_drained(pages.imm)

    def record_writes(self, imm: int, count: int) -> list[QuarantinedPages]:
        """Count writes that arrived for a stale imm (ignored when it is not quarantined)."""
        entry = self._entries.get(imm)
        if entry is None:
            return []
        entry.num_writes_seen += count
        return self._release_if_drained(imm)

    def acknowledge_abort(self, imm: int, num_writes_submitted: int) -> list[QuarantinedPages]:
        """The prefill side submits no write for ``imm`` any more, and submitted this many."""
        if num_writes_submitted < 0:
            raise ValueError(f"num_writes_submitted must be >= 0, got {num_writes_submitted}")
        entry = self._entries.get(imm)
        if entry is None:
            return []
        known = entry.num_writes_submitted
        entry.num_writes_submitted = (
            num_writes_submitted if known is None else min(known, num_writes_submitted)
        )
        return self._release_if_drained(imm)

    def peer_gone(self, peer: bytes) -> list[QuarantinedPages]:
        """The prefill process at ``peer`` is gone: nothing of it can land any more."""
        gone = [imm for imm, entry in self._entries.items() if entry.pages.peer == peer]
        return [self._entries.pop(imm).pages for imm in gone]

    def aborts_due(self, now_s: float) -> list[QuarantinedPages]:
        """Entries whose `AbortPrefill` is due (re-)sent now; each is next due an interval on."""
        due = [entry for entry in self._entries.values() if entry.next_abort_s <= now_s]
        for entry in due:
            entry.next_abort_s = now_s + self.resend_interval_s
        return [entry.pages for entry in due]

    @property
    def num_pages(self) -> int:
        return sum(len(entry.pages.page_ids) for entry in self._entries.values())

    def page_ids(self) -> set[int]:
        return {page for entry in self._entries.values() for page in entry.pages.page_ids}

    def peers(self) -> set[bytes]:
        return {entry.pages.peer for entry in self._entries.values()}

    def __contains__(self, imm: object) -> bool:
        return imm in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _release_if_drained(self, imm: int) -> list[QuarantinedPages]:
        if self._entries[imm].drained:
            return [self._entries.pop(imm).pages]
        return []
