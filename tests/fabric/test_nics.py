"""Several NICs per rank (`workers.fabric.nics`) over real ``tcp`` endpoints: the loopback
addresses 127.0.0.2 and 127.0.0.3 stand in for two NICs on each side.

- Writes carrying one imm through both NIC pairs land byte for byte and complete the one counter
  armed on the target's primary engine; each endpoint's stats show its share.
- Cancelling on the primary tombstones the value for every NIC: a late write through the other
  NIC is dropped, and taken by `take_imm_arrivals`.
- One engine of a set ending closes the shared counters: every engine of the set reports why,
  an armed counter fails, and nothing can be armed again.
- Entries that name no interface or address of this host, two entries for one address, and
  several NICs on shm are refused with errors that name them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from tests.waiting import wait_until
from workers.fabric import (
    EngineClosedError,
    FabricError,
    NicError,
    NicSet,
    TransferEngine,
    resolve_nic,
)

pytestmark = pytest.mark.timeout(120)

PROVIDER = "tcp;ofi_rxm"
NICS = ("127.0.0.2", "127.0.0.3")
PAGE = 4096
NUM_PAGES = 8


@pytest.fixture
def sets() -> Iterator[tuple[NicSet, NicSet]]:
    source, target = NicSet.open(PROVIDER, NICS), NicSet.open(PROVIDER, NICS)
    yield source, target
    for nics in (source, target):
        nics.close()
        assert not any(t.is_alive() for e in nics.engines for t in e.threads), "threads leaked"


def write_pages(
    source: NicSet, target: NicSet, src: np.ndarray, dst: np.ndarray, imm: int, pages: range
) -> list[FabricError]:
    """Page ``p`` of ``pages`` from source NIC ``p % 2`` to target NIC ``p % 2``, all with
    ``imm``; returns the errors reported (waits for every local completion)."""
    handles = [engine.register(src)[0] for engine in source.engines]
    descriptors = [engine.register(dst)[1] for engine in target.engines]
    done = threading.Semaphore(0)
    errors: list[FabricError] = []
    for page in pages:
        nic = page % 2
        engine = source.engines[nic]
        peer = engine.add_peer(target.engines[nic].address)
        engine.submit_write(
            handles[nic], page * PAGE, peer, descriptors[nic], page * PAGE, PAGE, imm=imm,
            on_done=done.release, on_error=lambda error: (errors.append(error), done.release()),
        )  # fmt: skip
    for _ in pages:
        assert done.acquire(timeout=30)
    return errors


def test_writes_through_both_nics_complete_one_counter(sets: tuple[NicSet, NicSet]) -> None:
    source, target = sets
    assert len(set(source.addresses)) == 2 and source.primary is source.engines[0]
    src = np.random.default_rng(1).integers(0, 255, NUM_PAGES * PAGE, dtype=np.uint8)
    dst = np.zeros_like(src)
    fired = threading.Event()
    target.primary.expect_imm(0x51, NUM_PAGES, fired.set)
    assert write_pages(source, target, src, dst, 0x51, range(NUM_PAGES)) == []
    assert fired.wait(30), "the counter never saw the writes of both NICs"
    np.testing.assert_array_equal(dst, src)
    # Each NIC carried half: posted by each source engine, landed on each target engine.
    assert [s.progress.ops_posted for s in source.stats()] == [NUM_PAGES // 2] * 2
    landed = [s.progress.imm_writes_received for s in target.stats()]
    assert landed == [NUM_PAGES // 2] * 2
    assert target.primary.stats().imm.received == NUM_PAGES  # one shared set of counters
    assert target.closed_reason() is None


def test_a_cancel_on_the_primary_drops_late_writes_on_every_nic(
    sets: tuple[NicSet, NicSet],
) -> None:
    source, target = sets
    src = np.ones(NUM_PAGES * PAGE, dtype=np.uint8)
    dst = np.zeros_like(src)
    target.primary.expect_imm(0x52, 100, lambda: None)
    assert target.primary.cancel_imm(0x52)
    assert write_pages(source, target, src, dst, 0x52, range(1, 2)) == []  # NIC 1 only
    wait_until(lambda: target.primary.imm_arrivals(0x52) == 1, what="the late write counted")
    assert target.primary.stats().imm.late_dropped == 1
    assert target.primary.take_imm_arrivals(0x52) == 1


def test_one_engine_ending_closes_the_counters_of_the_set(sets: tuple[NicSet, NicSet]) -> None:
    _, target = sets
    errors: list[FabricError] = []
    target.primary.expect_imm(0x53, 1, lambda: None, on_error=errors.append)
    target.engines[1].close()
    wait_until(lambda: bool(errors), what="the armed counter failed")
    assert isinstance(errors[0], EngineClosedError)
    reason = target.primary.closed_reason()
    assert reason is not None and "immediate counters closed" in reason
    assert target.closed_reason() is not None
    with pytest.raises(EngineClosedError):
        target.primary.expect_imm(0x54, 1, lambda: None)


def test_entries_are_interfaces_or_addresses_of_this_host() -> None:
    assert resolve_nic("lo") == "127.0.0.1"
    assert resolve_nic("127.0.0.3") == "127.0.0.3"
    with pytest.raises(NicError, match=r"'no-such-nic0' is neither an interface"):
        resolve_nic("no-such-nic0")
    with pytest.raises(NicError, match=r"'198\.51\.100\.77' is not an address of this host"):
        resolve_nic("198.51.100.77")  # TEST-NET-2: documentation only, no host has it
    with pytest.raises(NicError, match=r"'lo' and '127\.0\.0\.1' are both 127\.0\.0\.1"):
        NicSet.open(PROVIDER, ["lo", "127.0.0.1"])


def test_several_nics_on_shm_are_refused_and_sets_must_share_counters() -> None:
    with pytest.raises(ValueError, match="shm moves KV through this host's memory"):
        NicSet.open("shm", NICS)
    first, second = TransferEngine(PROVIDER, NICS[0]), TransferEngine(PROVIDER, NICS[1])
    try:
        with pytest.raises(ValueError, match="share the primary's counters"):
            NicSet([first, second])
    finally:
        first.close()
        second.close()
