"""Regressions of defects found in review: context slots, counters after the engine stopped,
callback order, stranded ops, concurrent `add_peer`, address-vector entries, int64 wrap."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from tests.fabric.harness import RemoteTarget
from workers.fabric import (
    AddressError,
    EngineClosedError,
    FabricError,
    OutOfRangeError,
    ProviderError,
    TransferEngine,
    progress,
    watchdog,
)
from workers.fabric.counters import ImmCounters
from workers.fabric.engine import MIN_FREE_OP_SLOTS
from workers.fabric.handles import PeerHandle

MIB = 1 << 20
pytestmark = pytest.mark.timeout(180)


def _wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Poll ``condition`` until it holds; False after ``timeout`` (a bound, not a measure)."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


# -- 1. context slots --------------------------------------------------------------------------


def test_too_few_context_slots_are_refused_at_construction(provider: str) -> None:
    """Each posted receive buffer holds a context slot for good: a pool no larger than the
    receive buffers left an engine whose progress thread had died (16) or that could never
    post a write (64). Both are refused up front, naming both settings."""
    for slots in (16, 64, 64 + MIN_FREE_OP_SLOTS - 1):
        with pytest.raises(ValueError, match=rf"max_inflight_ops={slots}.*num_receive_buffers=64"):
            TransferEngine(provider, max_inflight_ops=slots, num_receive_buffers=64)


def test_smallest_accepted_slot_pool_moves_writes(
    make_engine: Callable[..., TransferEngine],
) -> None:
    target = make_engine()
    engine = make_engine(num_receive_buffers=8, max_inflight_ops=8 + MIN_FREE_OP_SLOTS)
    _, descriptor = target.register(np.zeros(MIB, dtype=np.uint8))
    handle, _ = engine.register(np.ones(MIB, dtype=np.uint8))
    peer = engine.add_peer(target.address)
    reached = threading.Event()
    target.expect_imm(3, 256, reached.set)
    ops = np.array([[i * 4096, i * 4096, 4096] for i in range(256)], dtype=np.int64)
    engine.submit_writes(handle, peer, descriptor, ops, imm=3)  # more writes than free slots
    assert reached.wait(60)


def test_receive_buffers_the_provider_refuses_fail_the_constructor(provider: str) -> None:
    """More receive buffers than the provider's receive queue holds (tcp: EAGAIN, shm:
    ENOMEM here): posting them used to kill the progress thread after the constructor had
    returned. Now the constructor raises and leaves no thread behind."""
    before = {thread.name for thread in threading.enumerate()}
    with pytest.raises(ProviderError, match="fi_recv"):
        TransferEngine(
            provider, num_receive_buffers=8192, max_inflight_ops=8192 + 1024, max_message_bytes=64
        )
    leaked = {t.name for t in threading.enumerate() if t.name.startswith("fabric-")} - before
    assert _wait_until(
        lambda: not {t.name for t in threading.enumerate() if t.name in leaked}, timeout=10
    ), leaked


# -- 2. counters once the engine stopped --------------------------------------------------------


def test_expect_after_the_watchdog_abandoned_the_engine_raises(
    make_engine: Callable[..., TransferEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection (a provider call that never returns cannot be produced on demand): the
    watchdog abandons the engine. A counter armed afterwards would never fire nor expire (only
    the stuck thread checks deadlines), so arming raises instead."""
    real = progress.lib
    release = threading.Event()
    entered = threading.Event()

    class StuckPosts:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        @staticmethod
        def pd_post_writes(*args: Any) -> int:
            entered.set()
            release.wait(60)
            args[-1][0] = -real.FI_EAGAIN
            return 0

    monkeypatch.setattr(progress, "lib", StuckPosts())
    monkeypatch.setattr(watchdog, "_STALL_S", 0.2)
    monkeypatch.setattr(watchdog, "_WATCHDOG_PERIOD_S", 0.05)
    engine = make_engine(op_timeout=600.0)
    handle, descriptor = engine.register(np.zeros(4096, dtype=np.uint8))
    peer = engine.add_peer(engine.address)
    ended = threading.Event()
    engine.submit_write(handle, 0, peer, descriptor, 0, 64, imm=1, on_error=lambda _e: ended.set())
    try:
        assert entered.wait(30) and ended.wait(30)
        with pytest.raises(EngineClosedError, match="stuck"):
            engine.expect_imm(9, 1, lambda: None, lambda _e: None, timeout=0.2)
        with pytest.raises(EngineClosedError):  # the counters themselves refuse too
            engine.counters.expect(9, 1, lambda: None)
    finally:
        release.set()


def test_counters_refuse_arming_once_failed_all() -> None:
    counters = ImmCounters()
    errors: list[FabricError] = []
    assert counters.expect(1, 1, lambda: None, errors.append) == []
    fires = counters.fail_all(EngineClosedError("engine closed"))
    assert len(fires) == 1 and isinstance(fires[0][1][0], EngineClosedError)
    with pytest.raises(EngineClosedError, match="engine closed"):
        counters.expect(2, 1, lambda: None, errors.append)


# -- 3. callback order --------------------------------------------------------------------------


def test_imm_counter_fires_before_a_message_sent_after_the_write(
    make_engine: Callable[..., TransferEngine],
) -> None:
    """A message sent after an imm write is delivered (same CQ drain) after it: its handler
    runs after the counter's `on_reached`, as the callback thread promises event order."""
    target = make_engine()
    sender = make_engine()
    _, descriptor = target.register(np.zeros(1 << 16, dtype=np.uint8))
    handle, _ = sender.register(np.ones(1 << 16, dtype=np.uint8))
    peer = sender.add_peer(target.address)
    log: list[tuple[str, int]] = []  # appended on the callback thread only
    got = threading.Semaphore(0)

    def on_message(message: Any) -> None:
        log.append(("message", int(message.payload)))
        got.release()

    target.on_message(on_message)
    rounds = 40
    for index in range(1, rounds + 1):
        target.expect_imm(index, 1, lambda index=index: log.append(("imm", index)))
        time.sleep(0.05)  # the target goes idle: write and message land in one drain
        with sender.wakes_deferred():
            sender.submit_write(handle, 0, peer, descriptor, 0, 64, imm=index)
            sender.submit_send(peer, str(index).encode())
        assert got.acquire(timeout=30)
    target.close()  # runs every queued callback
    late = [i for i in range(1, rounds + 1) if log.index(("message", i)) < log.index(("imm", i))]
    assert late == []


# -- 4 and 6: writes stranded at a stopped peer -------------------------------------------------


@contextmanager
def _stranded_writes(engine: TransferEngine, target: RemoteTarget) -> Iterator[PeerHandle]:
    """Stop ``target`` (SIGSTOP) after a first write connected to it, post 64 MiB of writes
    to it and wait until their deadline failed the call with ops still posted (a stopped peer
    takes nothing). The target runs again (`resume`) when the block ends."""
    handle, _ = engine.register(np.ones(64 * MIB, dtype=np.uint8))
    peer = engine.add_peer(target.address)
    first = threading.Event()
    engine.submit_write(handle, 0, peer, target.descriptor, 0, 64, imm=4, on_done=first.set)
    assert first.wait(30)
    target.stop()
    try:
        ended = threading.Event()
        ops = np.array([[i * MIB, i * MIB, MIB] for i in range(64)], dtype=np.int64)
        engine.submit_writes(
            handle, peer, target.descriptor, ops, imm=5, on_error=lambda _e: ended.set()
        )
        assert ended.wait(60)
        assert engine.stats().progress.ops_stranded > 0
        yield peer
    finally:
        target.resume()


def test_ops_stranded_at_a_failed_peer_let_the_progress_thread_sleep(
    make_engine: Callable[..., TransferEngine], make_target: Callable[[int], RemoteTarget]
) -> None:
    """Ops posted to a peer that then failed may never complete (shm: a dead peer's never
    do). They used to keep the progress thread spinning a core forever; now they count as
    stranded, the thread sleeps on the CQ as when idle, and still frees them if they do."""
    target = make_target(64 * MIB)
    engine = make_engine(op_timeout=2.0)
    with _stranded_writes(engine, target):
        sleeps = engine.stats().progress.sleeps
        assert _wait_until(lambda: engine.stats().progress.sleeps >= sleeps + 20), "no sleep"
    # The peer runs again: the stranded ops complete and their contexts come back.
    assert _wait_until(lambda: engine.stats().progress.ops_stranded == 0)

    def all_ended() -> bool:
        stats = engine.stats().progress
        return stats.ops_completed + stats.error_completions == stats.ops_posted

    assert _wait_until(all_ended)


def test_forget_peer_removes_its_entry_once_nothing_is_posted_to_it(
    make_engine: Callable[..., TransferEngine], make_target: Callable[[int], RemoteTarget]
) -> None:
    """fi_av(3): ops in progress on a removed address are undefined, so the entry of a
    forgotten peer with ops still posted goes only when the last of them completed."""
    target = make_target(64 * MIB)
    engine = make_engine(op_timeout=2.0)
    handle, _ = engine.register(np.ones(4096, dtype=np.uint8))
    with _stranded_writes(engine, target) as old:
        engine.forget_peer(target.address)
        assert engine.stats().progress.peers_removed == 0  # ops to it are still posted
        with pytest.raises(AddressError):  # a forgotten handle is refused
            engine.submit_write(handle, 0, old, target.descriptor, 0, 64)
    assert _wait_until(lambda: engine.stats().progress.peers_removed == 1)
    peer = engine.add_peer(target.address)  # resolved afresh, healthy
    assert peer is not old and engine.peer_failure(target.address) is None
    done = threading.Event()
    engine.submit_write(handle, 0, peer, target.descriptor, 0, 4096, on_done=done.set)
    assert done.wait(30)


def test_forgotten_peers_leave_the_address_vector(
    provider: str, make_engine: Callable[..., TransferEngine]
) -> None:
    """shm's address vector holds 256 entries: forgetting must remove them, or the 257th
    peer incarnation cannot be added."""
    engine = make_engine()
    incarnations = 300 if provider == "shm" else 20
    for _ in range(incarnations):
        peer_engine = TransferEngine(provider, num_receive_buffers=1, num_send_buffers=1)
        try:
            engine.add_peer(peer_engine.address)
            engine.forget_peer(peer_engine.address)
        finally:
            peer_engine.close()
    assert engine.stats().progress.peers_removed == incarnations


# -- 5. concurrent add_peer ----------------------------------------------------------------------


def test_concurrent_add_peer_returns_one_handle(
    make_engine: Callable[..., TransferEngine],
) -> None:
    target = make_engine()
    engine = make_engine()
    handle, _ = engine.register(np.ones(4096, dtype=np.uint8))
    _, descriptor = target.register(np.zeros(4096, dtype=np.uint8))
    for _ in range(20):
        engine.forget_peer(target.address)
        barrier = threading.Barrier(4)
        handles: list[Any] = [None] * 4

        def add(
            index: int, barrier: threading.Barrier = barrier, handles: list[Any] = handles
        ) -> None:
            barrier.wait()
            handles[index] = engine.add_peer(target.address)

        threads = [threading.Thread(target=add, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert all(h is handles[0] for h in handles), handles
        done = threading.Event()
        engine.submit_write(handle, 0, handles[0], descriptor, 0, 16, on_done=done.set)
        assert done.wait(30)


# -- 7. range checks ------------------------------------------------------------------------------


def test_rows_whose_int64_end_wraps_are_refused(
    make_engine: Callable[..., TransferEngine],
) -> None:
    target = make_engine()
    engine = make_engine()
    handle, _ = engine.register(np.ones(4096, dtype=np.uint8))
    _, descriptor = target.register(np.zeros(4096, dtype=np.uint8))
    peer = engine.add_peer(target.address)
    huge = 1 << 62  # 2**62 + 2**62 wraps to -2**63 in int64
    for row in ([huge, 0, huge], [0, huge, huge], [huge, huge, huge], [-1, 0, 16], [0, -16, 16],
                [4096 - 16, 0, 17], [0, (1 << 63) - 1, 1]):  # fmt: skip
        ops = np.array([row], dtype=np.int64)
        with pytest.raises(OutOfRangeError):
            engine.prepare_writes(handle, peer, descriptor, ops)
        with pytest.raises(OutOfRangeError):
            engine.submit_writes(handle, peer, descriptor, ops)
    for kwargs in ({"src_stride": huge}, {"dst_stride": huge}, {"dst_offset": huge * 2 - 1},
                   {"src_offset": -(1 << 64)}):  # fmt: skip
        with pytest.raises(OutOfRangeError):
            engine.submit_paged_writes(handle, [0, 2], peer, descriptor, [0, 2], 16, **kwargs)
    # The edges still pass: a write that ends exactly at the end of both regions.
    done = threading.Event()
    ops = np.array([[4096 - 16, 4096 - 16, 16]], dtype=np.int64)
    engine.submit_writes(handle, peer, descriptor, ops, on_done=done.set)
    assert done.wait(30)
