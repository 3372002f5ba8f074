"""The CQ drain against a provider that misbehaves: a completion's flags are trusted only as
far as its context allows, and a CQ error entry that cannot be read ends the loop instead of
spinning in C (both NAMED TEST FAULT `fakes.FakeCqOps`); a wait fd that stays readable with
nothing to read (a real tcp socket closed before its handshake) turns waits into naps."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

import numpy as np
import pytest

from tests.fabric.fakes import (
    BindingLog,
    FakeCqOps,
    always_an_error,
    misflag_local_completions,
    unreadable_error,
)
from tests.waiting import wait_until
from workers.fabric import EngineClosedError, FabricError, TransferEngine
from workers.fabric.messages import RECEIVE_ID_BASE, Message
from workers.kv.peer_liveness import tcp_address

pytestmark = pytest.mark.timeout(180)


def test_local_completions_flagged_as_remote_data_stay_local(
    make_engine: Callable[..., TransferEngine],
) -> None:
    """With FI_REMOTE_CQ_DATA set on a completion of our own write, the write must neither
    count as an arrival nor have its context slot reposted as a receive buffer (at a wild
    address): the flag is trusted only for receive slots."""
    target = make_engine()
    engine = make_engine()
    _, descriptor = target.register(np.zeros(4096, dtype=np.uint8))
    handle, _ = engine.register(np.ones(4096, dtype=np.uint8))
    peer = engine.add_peer(target.address)
    fake = FakeCqOps(engine, read=misflag_local_completions)
    fake.install()
    try:
        for index in range(20):
            done, landed = threading.Event(), threading.Event()
            target.expect_imm(index, 1, landed.set)
            engine.submit_write(handle, 0, peer, descriptor, 0, 64, imm=index, on_done=done.set)
            assert done.wait(30) and landed.wait(30)
        assert engine.stats().imm.received == 0
        assert engine.closed_reason() is None
    finally:
        fake.remove()
    with pytest.raises(FabricError, match="receive buffers"):  # never a wild address
        engine._loop.call(lambda: engine._pools.repost_receive(engine._native, 5))
    with pytest.raises(FabricError, match="receive buffers"):
        engine._loop.call(lambda: engine._pools.repost_receive(engine._native, RECEIVE_ID_BASE - 1))


def test_an_unreadable_cq_error_ends_the_loop_instead_of_spinning(
    make_engine: Callable[..., TransferEngine], binding_log: BindingLog
) -> None:
    """fi_cq_read reports an error entry that fi_cq_readerr cannot return: the failure
    reaches the loop, which ends its operations and stops (rather than pd_poll looping on it
    until the watchdog abandons the engine).

    The loop was sleeping when it failed (idle_spin_us=0): its sleeping flag is cleared, so a
    later wake does not write to the freed engine. And a region deregistered after the loop
    died is still closed by `close` (the domain would refuse to close: EBUSY)."""
    engine = make_engine(idle_spin_us=0)
    handle, _ = engine.register(np.ones(4096, dtype=np.uint8))
    fake = FakeCqOps(engine, read=always_an_error, readerr=unreadable_error)
    fake.install()
    try:
        wait_until(lambda: not engine._loop.thread.is_alive(), what="the progress thread to end")
        assert engine.closed_reason() == "engine is closed"  # ended, not abandoned as stuck
    finally:
        fake.remove()
    with pytest.raises(EngineClosedError):
        engine.deregister(handle)
    engine.close()
    assert binding_log.closed(handle)
    assert ("engine_close", 0) in binding_log.events
    engine._loop.waker.wake()  # e.g. a `wakes_deferred` block ending after the close
    assert binding_log.late_wakes == 0


def test_a_connection_closed_before_its_handshake_does_not_keep_the_thread_spinning(
    provider: str, make_engine: Callable[..., TransferEngine]
) -> None:
    """tcp: a bare connect and close to an engine's listener (a port scan, a TCP health check)
    stays in libfabric 1.17's poll set, readable for good, so every CQ wait returns at once and
    the idle progress thread would spin a core from then on. The engine stops waiting on that
    fd (its waits become naps) and still moves messages and counted writes."""
    if provider != "tcp;ofi_rxm":
        pytest.skip("shm has no listening socket (and no CQ wait fd)")
    engine = make_engine()
    sender = make_engine()
    address = tcp_address(sender.add_peer(engine.address).name)
    assert address is not None
    assert not engine.stats().progress.wait_fd_dropped
    socket.create_connection(address, timeout=10).close()
    wait_until(lambda: engine.stats().progress.wait_fd_dropped, what="the wait fd dropped")
    messages: list[Message] = []
    arrived, landed = threading.Event(), threading.Event()
    engine.on_message(lambda message: (messages.append(message), arrived.set()))
    _, descriptor = engine.register(np.zeros(4096, dtype=np.uint8))
    handle, _ = sender.register(np.full(4096, 7, dtype=np.uint8))
    peer = sender.add_peer(engine.address)
    engine.expect_imm(3, 1, landed.set)
    sender.submit_write(handle, 0, peer, descriptor, 0, 4096, imm=3)
    sender.submit_send(peer, b"after the write")
    assert landed.wait(30) and arrived.wait(30)
    assert [m.payload for m in messages] == [b"after the write"]
    assert engine.closed_reason() is None
