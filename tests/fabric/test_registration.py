"""Deregistering a region that writes still use: refused for new writes at once, closed only
once the writes from it have ended (closing it under a queued or posted write would hand the
provider a closed registration's descriptor). Uses the spy `fakes.BindingLog`."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest

from tests.fabric.fakes import BindingLog
from tests.fabric.harness import RemoteTarget
from tests.waiting import wait_until
from workers.fabric import FabricError, RegistrationError, TransferEngine

MIB = 1 << 20
pytestmark = pytest.mark.timeout(180)


def test_deregister_keeps_a_queued_writes_region_registered_until_it_ended(
    make_engine: Callable[..., TransferEngine], binding_log: BindingLog
) -> None:
    """Commands run first in each pass of the progress thread, so a `deregister` arrives
    there before a write queued from the region was posted: the close waits for the write."""
    target = make_engine()
    engine = make_engine()
    _, descriptor = target.register(np.zeros(MIB, dtype=np.uint8))
    handle, _ = engine.register(np.full(MIB, 7, dtype=np.uint8))
    peer = engine.add_peer(target.address)
    landed, done = threading.Event(), threading.Event()
    target.expect_imm(1, 1, landed.set)
    with engine.wakes_deferred():  # the write stays queued until the deregister is shipped
        engine.submit_write(handle, 0, peer, descriptor, 0, MIB, imm=1, on_done=done.set)
        engine.deregister(handle)
        with pytest.raises(RegistrationError):  # refused from now on
            engine.submit_write(handle, 0, peer, descriptor, 0, 64)
    assert landed.wait(30) and done.wait(30)
    wait_until(lambda: binding_log.closed(handle), what="the region closed")
    kinds = [kind for kind, value in binding_log.events if kind == "post" or value == handle.mr]
    assert kinds == ["post", "close"], binding_log.events
    # Without a write using it, a region is closed before `deregister` returns.
    idle, _ = engine.register(np.zeros(4096, dtype=np.uint8))
    engine.deregister(idle)
    assert binding_log.closed(idle)


def test_deregister_waits_for_writes_in_flight_to_a_stopped_target(
    make_engine: Callable[..., TransferEngine],
    make_target: Callable[[int], RemoteTarget],
    binding_log: BindingLog,
) -> None:
    """Writes posted to a stopped target cannot complete: the region they read from stays
    registered until they did (the target runs again)."""
    for _attempt in range(3):
        if _in_flight_deregister_scenario(make_engine, make_target, binding_log):
            return
    pytest.fail("every attempt stopped the target while it held its shm lock")


def _in_flight_deregister_scenario(
    make_engine: Callable[..., TransferEngine],
    make_target: Callable[[int], RemoteTarget],
    binding_log: BindingLog,
) -> bool:
    """False if the initiator was abandoned (shm: the stop landed inside the target's lock)."""
    target = make_target(MIB)
    engine = make_engine()
    handle, _ = engine.register(np.ones(MIB, dtype=np.uint8))
    peer = engine.add_peer(target.address)
    first = threading.Event()
    engine.submit_write(handle, 0, peer, target.descriptor, 0, 64, imm=4, on_done=first.set)
    assert first.wait(30)
    target.stop()
    done = threading.Event()
    errors: list[FabricError] = []
    try:
        ops = np.array([[0, 0, MIB]] * 64, dtype=np.int64)  # 64 MiB: more than sockets buffer
        engine.submit_writes(handle, peer, target.descriptor, ops, imm=5, on_done=done.set,
                             on_error=errors.append)  # fmt: skip
        wait_until(
            lambda: engine.stats().progress.ops_posted > 1 or bool(errors), what="writes posted"
        )
        if errors:
            return False
        engine.deregister(handle)
        assert not done.is_set()  # the target is stopped: writes are still in flight
        assert not binding_log.closed(handle)
    finally:
        target.resume()
    wait_until(lambda: done.is_set() or bool(errors), timeout=60, what="the writes ended")
    if errors and "stuck" in str(errors[0]):
        return False
    assert done.is_set(), errors
    wait_until(lambda: binding_log.closed(handle), what="the region closed")
    target.expect([5], 64)  # landed before the target closes (rxm crashes closing mid-stream)
    assert target.wait_for("reached")["imm"] == 5
    return True
