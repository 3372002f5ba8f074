"""What an engine's sizes allow: operation context slots (each posted receive buffer holds one
for good), receive buffers the provider takes, and CQ waits the watchdog tolerates; and what
becomes of a call that no slot is left for."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest

from tests.fabric.harness import RemoteTarget
from tests.waiting import wait_until
from workers.fabric import (
    OperationTimeoutError,
    ProviderError,
    TransferEngine,
    TransferError,
)
from workers.fabric._lib import lib
from workers.fabric.engine import MAX_POLL_US, MIN_FREE_OP_SLOTS

MIB = 1 << 20
pytestmark = pytest.mark.timeout(180)


def test_too_few_context_slots_are_refused_at_construction(provider: str) -> None:
    """A slot pool no larger than the receive buffers would leave an engine whose progress
    thread dies (16) or that can never post a write (64): refused up front, naming both
    settings."""
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
    ENOMEM here): the constructor raises and leaves no thread behind, rather than return an
    engine whose progress thread then dies posting them."""
    before = {thread.name for thread in threading.enumerate()}
    with pytest.raises(ProviderError, match="fi_recv"):
        TransferEngine(
            provider, num_receive_buffers=8192, max_inflight_ops=8192 + 1024, max_message_bytes=64
        )
    leaked = {t.name for t in threading.enumerate() if t.name.startswith("fabric-")} - before
    wait_until(
        lambda: not {t.name for t in threading.enumerate() if t.name in leaked},
        timeout=10,
        what=f"threads {leaked} to end",
    )


def test_poll_waits_the_watchdog_would_take_for_a_stall_are_refused(provider: str) -> None:
    """An idle engine waits `idle_wait_us` inside one native call; one longer than the
    watchdog's stall threshold would get the idle engine abandoned."""
    for options in ({"idle_wait_us": MAX_POLL_US + 1}, {"idle_wait_us": 5_000_000},
                    {"spin_us": MAX_POLL_US + 1}, {"idle_wait_us": -1}):  # fmt: skip
        with pytest.raises(ValueError, match="watchdog"):
            TransferEngine(provider, **options)
    TransferEngine(provider, idle_wait_us=MAX_POLL_US).close()


def test_a_job_starved_of_op_slots_ends_alone_without_failing_its_peer(
    make_engine: Callable[..., TransferEngine], make_target: Callable[[int], RemoteTarget]
) -> None:
    """Writes to a stopped target hold every context slot; a write to a healthy peer then
    cannot be posted. At its deadline it ends alone in `TransferError` naming the shortage,
    and its peer is not failed ("peer unreachable or dead" would be wrong: the shortage is
    this engine's)."""
    for _attempt in range(3):
        if _starved_scenario(make_engine, make_target):
            return
    pytest.fail("every attempt stopped the target while it held its shm lock")


def _starved_scenario(
    make_engine: Callable[..., TransferEngine], make_target: Callable[[int], RemoteTarget]
) -> bool:
    """False if the initiator was abandoned (shm: the stop landed inside the target's lock)."""
    stopped = make_target(MIB)
    healthy = make_engine()
    _, healthy_descriptor = healthy.register(np.zeros(MIB, dtype=np.uint8))
    engine = make_engine(
        op_timeout=3.0, num_receive_buffers=8, max_inflight_ops=8 + MIN_FREE_OP_SLOTS
    )
    handle, _ = engine.register(np.ones(MIB, dtype=np.uint8))
    stopped_peer = engine.add_peer(stopped.address)
    healthy_peer = engine.add_peer(healthy.address)
    for peer, descriptor in (
        (stopped_peer, stopped.descriptor),
        (healthy_peer, healthy_descriptor),
    ):
        connected = threading.Event()
        engine.submit_write(handle, 0, peer, descriptor, 0, 64, on_done=connected.set)
        assert connected.wait(30)
    stopped.stop()
    outcome: list[object] = []
    unposted: list[int] = []
    ended = threading.Semaphore(0)

    def record(what: object) -> None:
        outcome.append(what)
        ended.release()

    try:
        # With immediate data (shm completes plain writes without the target's help).
        ops = np.array([[0, 0, MIB]] * (4 * MIN_FREE_OP_SLOTS), dtype=np.int64)
        engine.submit_writes(handle, stopped_peer, stopped.descriptor, ops, imm=2,
                             on_error=record, on_unposted=lambda n, _b, _e: unposted.append(n))  # fmt: skip
        wait_until(
            lambda: lib.pd_engine_free_slots(engine._native) == 0 or bool(outcome),
            what="every operation slot taken",
        )
        engine.submit_write(handle, 0, healthy_peer, healthy_descriptor, 0, 64,
                            on_done=lambda: record("done"), on_error=record)  # fmt: skip
        assert ended.acquire(timeout=60) and ended.acquire(timeout=60)
    finally:
        stopped.resume()
    if any("stuck" in str(what) for what in outcome):
        return False
    stopped_error, healthy_outcome = outcome
    assert isinstance(stopped_error, OperationTimeoutError), outcome
    assert type(healthy_outcome) is TransferError, outcome
    assert "never posted" in str(healthy_outcome) and "operation slot" in str(healthy_outcome)
    assert engine.peer_failure(healthy.address) is None
    # Slots come back as the stopped target catches up; the healthy peer takes writes again.
    done = threading.Event()
    engine.submit_write(handle, 0, healthy_peer, healthy_descriptor, 0, 64, on_done=done.set)
    assert done.wait(60)
    # What was posted to the stopped target lands before it closes (rxm crashes closing
    # an endpoint mid-stream).
    stopped.expect([2], len(ops) - sum(unposted))
    assert stopped.wait_for("reached")["imm"] == 2
    return True
