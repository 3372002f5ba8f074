"""Immediate counters fed by real remote writes (target in a spawned process)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from tests.fabric.harness import RemoteTarget
from workers.fabric import MemoryRegionHandle, PeerHandle, TransferEngine

pytestmark = pytest.mark.timeout(120)


class Writer:
    def __init__(self, engine: TransferEngine, target: RemoteTarget) -> None:
        self.engine = engine
        self.target = target
        self.handle: MemoryRegionHandle = engine.register(np.ones(4096, dtype=np.uint8))[0]
        self.peer: PeerHandle = engine.add_peer(target.address)
        self.pending = threading.Semaphore(0)
        self.errors: list[BaseException] = []

    def write(self, imm: int, times: int = 1) -> None:
        for _ in range(times):
            self.engine.submit_write(
                self.handle, 0, self.peer, self.target.descriptor, 0, 64, imm=imm,
                on_done=self.pending.release, on_error=self.errors.append,
            )  # fmt: skip

    def drain(self, times: int) -> None:
        for _ in range(times):
            assert self.pending.acquire(timeout=30)
        assert not self.errors


def _settle(target: RemoteTarget, received: int) -> dict[str, int]:
    """Target stats once it has seen `received` writes (local completion != landed on tcp)."""
    deadline = time.monotonic() + 30
    while True:
        stats = target.stats()
        if stats["received"] >= received or time.monotonic() > deadline:
            return stats
        time.sleep(0.01)


@pytest.fixture
def writer(
    make_engine: Callable[..., TransferEngine], make_target: Callable[[int], RemoteTarget]
) -> Writer:
    return Writer(make_engine(), make_target(4096))


def test_fires_once_at_count_not_before(writer: Writer) -> None:
    target = writer.target
    target.expect([5], 10)
    writer.write(5, 9)
    writer.drain(9)
    _settle(target, 9)
    assert target.poll_event(0.2) is None
    writer.write(5)
    writer.drain(1)
    assert target.wait_for("reached")["imm"] == 5
    assert target.poll_event(0.2) is None
    assert target.stats()["fired"] == 1


def test_writes_before_expect_count(writer: Writer) -> None:
    target = writer.target
    writer.write(6, 3)
    writer.drain(3)
    stats = _settle(target, 3)
    assert stats["unexpected_values"] == 1
    target.expect([6], 3)
    assert target.wait_for("reached")["imm"] == 6


def test_thousand_concurrent_counters(writer: Writer) -> None:
    target = writer.target
    imms = list(range(1000, 2000))
    target.expect(imms, 2)
    order = np.random.default_rng(3).permutation(np.repeat(imms, 2))
    for imm in order.tolist():
        writer.write(imm)
    writer.drain(len(order))
    reached = [target.wait_for("reached")["imm"] for _ in imms]
    assert sorted(reached) == imms
    assert target.stats()["fired"] == 1000


def test_cancel_ignores_late_writes_until_rearmed(writer: Writer) -> None:
    target = writer.target
    target.expect([7], 5)
    writer.write(7, 2)
    writer.drain(2)
    _settle(target, 2)
    assert target.cancel(7)
    writer.write(7, 3)  # late writes of the cancelled transfer
    writer.drain(3)
    stats = _settle(target, 5)
    assert stats["late_dropped"] == 3
    assert stats["unexpected_values"] == 0
    target.expect([7], 2)  # re-armed: the dropped writes must not count
    writer.write(7)
    writer.drain(1)
    _settle(target, 6)
    assert target.poll_event(0.2) is None
    writer.write(7)
    writer.drain(1)
    assert target.wait_for("reached")["imm"] == 7
