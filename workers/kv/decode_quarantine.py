"""The decoder's quarantined transfers: `PageQuarantine`'s rule fed with every write that lands
for them, and their pages handed back once it lets them go.

Writes are counted here (`TransferEngine.take_imm_arrivals`), not left in the fabric: its
tombstones are bounded (and a later cancellation may evict one), so each poll takes the new
arrivals of every quarantined imm (`count_arrivals`). A release is handed to ``free`` with how it
came (``drained``: every write that can land did; ``peer_gone``: the prefill process is gone)
and how many writes landed in all.
"""

from __future__ import annotations

from collections.abc import Callable

from workers.fabric import TransferEngine
from workers.kv.quarantine import PageQuarantine, QuarantinedPages

_UNKNOWN_COUNT = 1 << 62  # quarantine bound while the prefill side never told its count

# (pages, how they were released, writes landed in all)
Free = Callable[[QuarantinedPages, str, int], None]


class QuarantineLedger:
    def __init__(self, fabric: TransferEngine, quarantine: PageQuarantine, free: Free) -> None:
        self._fabric = fabric
        self._quarantine = quarantine
        self._free = free
        self._landed: dict[int, int] = {}  # imm -> writes landed so far

    def hold(
        self,
        pages: QuarantinedPages,
        *,
        num_writes_expected: int | None,
        fired: bool,
        acknowledged: int | None,
        now_s: float,
    ) -> None:
        """Quarantine a failed transfer's pages (its counter just cancelled). ``fired``: its
        armed counter had reached the count; ``acknowledged``: the prefill side is known to
        have submitted that many writes and no more (0: the request never reached its
        engine)."""
        imm = pages.imm
        landed = self._fabric.take_imm_arrivals(imm)
        seen = num_writes_expected if fired and num_writes_expected else landed
        self._landed[imm] = seen
        released = self._quarantine.hold(
            pages,
            num_writes_expected=num_writes_expected or _UNKNOWN_COUNT,
            num_writes_seen=seen,
            now_s=now_s,
        )
        if acknowledged is not None:
            released += self._quarantine.acknowledge_abort(imm, acknowledged)
        self._release(released)

    def count_arrivals(self) -> None:
        released: list[QuarantinedPages] = []
        for imm in list(self._landed):
            landed = self._fabric.take_imm_arrivals(imm)
            if landed:
                self._landed[imm] += landed
                released += self._quarantine.record_writes(imm, landed)
        self._release(released)

    def acknowledge(self, imm: int, num_writes_submitted: int) -> None:
        """The prefill side submitted that many writes for ``imm`` and will submit no more."""
        self._release(self._quarantine.acknowledge_abort(imm, num_writes_submitted))

    def peer_gone(self, address: bytes) -> None:
        """The prefill process at ``address`` is gone: none of its writes can land any more."""
        self._release(self._quarantine.peer_gone(address), "peer_gone")

    def _release(self, released: list[QuarantinedPages], how: str = "drained") -> None:
        for pages in released:
            landed = self._landed.pop(pages.imm, 0) + self._fabric.take_imm_arrivals(pages.imm)
            self._free(pages, how, landed)
