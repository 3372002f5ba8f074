from __future__ import annotations

import pytest

from workers.kv.errors import ImmError, SlotsExhaustedError
from workers.kv.imm import ImmLayout, SlotTable


def test_layout_encodes_slot_low_and_generation_high() -> None:
    layout = ImmLayout()
    assert layout.num_slots == 1 << 20 and layout.num_generations == 1 << 12
    imm = layout.encode(5, 3)
    assert imm == 3 << 20 | 5 and layout.decode(imm) == (5, 3)
    assert layout.decode(layout.encode(layout.num_slots - 1, layout.num_generations - 1)) == (
        layout.num_slots - 1,
        layout.num_generations - 1,
    )
    with pytest.raises(ImmError):
        layout.encode(layout.num_slots, 0)
    with pytest.raises(ImmError):
        layout.encode(0, layout.num_generations)
    with pytest.raises(ImmError):
        layout.decode(1 << 32)


@pytest.mark.parametrize(("slot_bits", "generation_bits"), [(0, 12), (20, 0), (24, 9)])
def test_invalid_layouts(slot_bits: int, generation_bits: int) -> None:
    with pytest.raises(ImmError):
        ImmLayout(slot_bits, generation_bits)


def test_layout_checked_against_provider_cq_data_size() -> None:
    ImmLayout().check_provider(4)
    ImmLayout().check_provider(8)
    ImmLayout(8, 8).check_provider(2)
    with pytest.raises(ImmError, match="CQ data"):
        ImmLayout().check_provider(2)
    with pytest.raises(ImmError):
        ImmLayout(1, 1).check_provider(0)


def test_late_write_of_released_transfer_is_stale() -> None:
    table = SlotTable(ImmLayout(2, 3), num_slots=1)
    old = table.allocate("a")
    assert table.resolve(old) == "a"
    assert table.release(old) == "a"
    assert table.resolve(old) is None
    new = table.allocate("b")
    assert new != old and table.layout.decode(new) == (0, 1)
    assert table.resolve(old) is None and table.resolve(new) == "b"
    with pytest.raises(ImmError, match="not a live"):
        table.release(old)


def test_generation_wraps_around() -> None:
    table = SlotTable(ImmLayout(1, 2), num_slots=1)
    imms = []
    for i in range(5):
        imm = table.allocate(f"r{i}")
        imms.append(imm)
        table.release(imm)
    assert [table.layout.decode(imm)[1] for imm in imms] == [0, 1, 2, 3, 0]


def test_free_slots_are_reused_oldest_first() -> None:
    table = SlotTable(ImmLayout(4, 4), num_slots=3)
    a, b, c = (table.allocate(name) for name in "abc")
    table.release(b)
    table.release(a)
    assert table.layout.decode(table.allocate("d"))[0] == table.layout.decode(b)[0]
    assert table.layout.decode(table.allocate("e"))[0] == table.layout.decode(a)[0]
    assert table.resolve(c) == "c"


def test_exhaustion_is_a_typed_error() -> None:
    table = SlotTable(ImmLayout(2, 2))
    assert table.capacity == 4
    for i in range(4):
        table.allocate(str(i))
    with pytest.raises(SlotsExhaustedError):
        table.allocate("x")
    with pytest.raises(ImmError):
        SlotTable(ImmLayout(2, 2), num_slots=5)


def test_parked_slot_is_not_reused_until_recycled() -> None:
    table = SlotTable(ImmLayout(2, 2), num_slots=1)
    imm = table.allocate("a")
    table.release(imm, drained=False)
    assert table.num_parked == 1 and table.resolve(imm) is None
    with pytest.raises(SlotsExhaustedError):
        table.allocate("b")
    table.recycle(imm)
    assert table.resolve(table.allocate("b")) == "b"
    with pytest.raises(ImmError, match="not parked"):
        table.recycle(imm)


def test_garbage_imms_resolve_to_nothing() -> None:
    table = SlotTable(ImmLayout(4, 4), num_slots=2)
    table.allocate("a")
    assert table.resolve(-1) is None
    assert table.resolve(1 << 8) is None
    assert table.resolve(3) is None  # slot beyond capacity
