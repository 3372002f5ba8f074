"""Immediate counters fed by real remote writes (target in a spawned process), and arming a
counter on an engine its watchdog abandoned."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tests.fabric.harness import RemoteTarget, StuckPosts
from tests.waiting import wait_until
from workers.fabric import (
    EngineClosedError,
    MemoryRegionHandle,
    PeerHandle,
    TransferEngine,
    progress,
    watchdog,
)

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


def _settle(target: RemoteTarget, received: int) -> dict[str, Any]:
    """Target stats once it has seen `received` writes (local completion != landed on tcp)."""
    last: list[dict[str, Any]] = []

    def landed() -> bool:
        last[:] = [target.stats()]
        return int(last[0]["received"]) >= received

    wait_until(landed, what=f"{received} writes landed at the target")
    return last[0]


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


def test_expect_after_the_watchdog_abandoned_the_engine_raises(
    make_engine: Callable[..., TransferEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watchdog abandons the engine (NAMED TEST FAULT `StuckPosts`: a provider call that
    never returns cannot be produced on demand). A counter armed afterwards would never fire
    nor expire (only the stuck thread checks deadlines), so arming raises instead."""
    monkeypatch.setattr(watchdog, "_STALL_S", 0.2)
    monkeypatch.setattr(watchdog, "_WATCHDOG_PERIOD_S", 0.05)
    stuck = StuckPosts(progress.lib)
    monkeypatch.setattr(progress, "lib", stuck)
    engine = make_engine(op_timeout=600.0)
    handle, descriptor = engine.register(np.zeros(4096, dtype=np.uint8))
    peer = engine.add_peer(engine.address)
    ended = threading.Event()
    stuck.armed.set()
    engine.submit_write(handle, 0, peer, descriptor, 0, 64, imm=1, on_error=lambda _e: ended.set())
    try:
        assert stuck.entered.wait(30) and ended.wait(30)
        with pytest.raises(EngineClosedError, match="stuck"):
            engine.expect_imm(9, 1, lambda: None, lambda _e: None, timeout=0.2)
        with pytest.raises(EngineClosedError):  # the counters themselves refuse too
            engine.counters.expect(9, 1, lambda: None)
    finally:
        stuck.release.set()
