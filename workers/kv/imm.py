"""Immediate data: which transfer a one-sided write belongs to.

Every KV write of a transfer carries the same 32-bit immediate value (remote CQ data)::

    imm = generation << slot_bits | slot        (default: 20 bits slot, 12 bits generation)

A *slot* indexes the decoder's live transfers; it is reused once its transfer ends. The
*generation* is bumped every time a slot is released, so a late write of a cancelled or finished
transfer carries an old generation and resolves to nothing instead of counting toward the newer
transfer that reuses the slot. Free slots are reused oldest-first, so a generation can only
alias after ``2**generation_bits`` full rounds through every free slot. A transfer that ended
*without* all its writes (failed, aborted) is released with ``drained=False``: its slot is parked
until its pages leave quarantine (`workers.kv.quarantine`) and then recycled, so an imm whose
writes may still land is never handed out again, however small the table.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from workers.kv.errors import ImmError, SlotsExhaustedError

IMM_BITS = 32  # the widest immediate every provider we target carries (verbs/efa: 4 bytes)


@dataclass(frozen=True)
class ImmLayout:
    slot_bits: int = 20
    generation_bits: int = 12

    def __post_init__(self) -> None:
        if self.slot_bits < 1 or self.generation_bits < 1:
            raise ImmError(f"slot and generation need >= 1 bit each: {self}")
        if self.total_bits > IMM_BITS:
            raise ImmError(f"{self.total_bits} bits do not fit a {IMM_BITS}-bit immediate")

    @property
    def total_bits(self) -> int:
        return self.slot_bits + self.generation_bits

    @property
    def num_slots(self) -> int:
        return 1 << self.slot_bits

    @property
    def num_generations(self) -> int:
        return 1 << self.generation_bits

    def check_provider(self, cq_data_size: int) -> None:
        """Fail unless the provider's remote CQ data (``fi_domain_attr.cq_data_size``, in
        bytes) carries every bit of the layout."""
        if cq_data_size * 8 < self.total_bits:
            raise ImmError(
                f"provider carries {cq_data_size} bytes of CQ data; the imm layout needs "
                f"{self.total_bits} bits"
            )

    def encode(self, slot: int, generation: int) -> int:
        if not 0 <= slot < self.num_slots:
            raise ImmError(f"slot {slot} outside [0, {self.num_slots})")
        if not 0 <= generation < self.num_generations:
            raise ImmError(f"generation {generation} outside [0, {self.num_generations})")
        return generation << self.slot_bits | slot

    def decode(self, imm: int) -> tuple[int, int]:
        """``(slot, generation)`` of an immediate value."""
        if not 0 <= imm < 1 << self.total_bits:
            raise ImmError(f"imm {imm:#x} does not fit {self.total_bits} bits")
        return imm & (self.num_slots - 1), imm >> self.slot_bits


class SlotTable:
    """The decoder's live transfers by slot; turns an incoming imm into a request id.

    Not thread-safe: owned by the messenger thread (fabric callbacks only enqueue imms).
    """

    def __init__(self, layout: ImmLayout, num_slots: int | None = None) -> None:
        capacity = layout.num_slots if num_slots is None else num_slots
        if not 1 <= capacity <= layout.num_slots:
            raise ImmError(f"num_slots must be in [1, {layout.num_slots}], got {num_slots}")
        self.layout = layout
        self._generations = [0] * capacity
        self._owners: list[str | None] = [None] * capacity
        self._free: deque[int] = deque(range(capacity))  # oldest-released first
        self._parked: set[int] = set()  # slots whose old imm may still receive writes

    @property
    def capacity(self) -> int:
        return len(self._owners)

    @property
    def num_live(self) -> int:
        return self.capacity - len(self._free)

    def allocate(self, request_id: str) -> int:
        """Reserve a slot for ``request_id``; returns the imm its writes must carry."""
        if not self._free:
            raise SlotsExhaustedError(f"all {self.capacity} transfer slots are live")
        slot = self._free.popleft()
        self._owners[slot] = request_id
        return self.layout.encode(slot, self._generations[slot])

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def release(self, imm: int, *, drained: bool = True) -> str:
        """End the transfer of ``imm``; returns its request id.

        The slot's generation moves on now, so every later write carrying ``imm`` is stale.
        ``drained=False`` (writes may still land) parks the slot until `recycle` is called.
        """
        request_id = self.resolve(imm)
        if request_id is None:
            raise ImmError(f"imm {imm:#x} is not a live transfer")
        slot, generation = self.layout.decode(imm)
        self._owners[slot] = None
        self._generations[slot] = (generation + 1) % self.layout.num_generations
        if drained:
            self._free.append(slot)
        else:
            self._parked.add(slot)
        return request_id

    def recycle(self, imm: int) -> None:
        """Return the parked slot of the (old) ``imm`` once no write carrying it can land."""
        slot, _ = self.layout.decode(imm)
        if slot not in self._parked:
            raise ImmError(f"slot of imm {imm:#x} is not parked")
        self._parked.remove(slot)
        self._free.append(slot)

    def resolve(self, imm: int) -> str | None:
        """The request id of the live transfer ``imm`` belongs to, or None if stale.

        Stale: the slot is free, or its transfer was released (the generation moved on), or the
        value is not an imm of this table at all -- a peer's bug must not crash the decoder.
        """
        if not 0 <= imm < 1 << self.layout.total_bits:
            return None
        slot, generation = self.layout.decode(imm)
        if slot >= self.capacity or generation != self._generations[slot]:
            return None
        return self._owners[slot]
