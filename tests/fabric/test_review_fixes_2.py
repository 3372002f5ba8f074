"""Regressions of a second review: deregistering a region in use, `close` that cannot wait for
the progress thread, malformed messages, jobs starved of context slots, completions whose flags
lie, a failing CQ error read, and poll waits the watchdog would take for a stall.

Two stand-ins are used, both named as such: `BindingLog`, a spy that records some calls into
the real binding (and keeps a late wake from reaching a freed engine), and `FakeCqOps`, a
NAMED TEST FAULT that swaps the provider's CQ read functions for ones that misbehave in ways a
real provider here cannot be made to (a local completion flagged FI_REMOTE_CQ_DATA, an error
entry that cannot be read).
"""

from __future__ import annotations

import ctypes
import errno
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tests.fabric.harness import RemoteTarget, StuckPosts
from tests.fabric.test_review_fixes import _wait_until
from workers.fabric import (
    EngineClosedError,
    FabricError,
    Message,
    OperationTimeoutError,
    PeerFailedError,
    RegistrationError,
    TransferEngine,
    TransferError,
    progress,
    watchdog,
)
from workers.fabric import engine as engine_module
from workers.fabric._lib import ffi, lib
from workers.fabric.engine import MAX_POLL_US, MIN_FREE_OP_SLOTS
from workers.fabric.jobs import SEND, Job
from workers.fabric.messages import RECEIVE_ID_BASE

MIB = 1 << 20
pytestmark = pytest.mark.timeout(180)


class BindingLog:
    """A spy in place of the binding (`progress.lib`, `engine.lib`): forwards every call and
    records write posts, region and endpoint closes, and wakes. A wake of an endpoint already
    closed is recorded and not forwarded (it would write to a freed engine)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.events: list[tuple[str, Any]] = []
        self.closed_engines: list[Any] = []
        self.late_wakes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def pd_post_writes(self, *args: Any) -> int:
        posted = int(self.real.pd_post_writes(*args))
        if posted:
            self.events.append(("post", posted))
        return posted

    def pd_mr_close(self, mr: Any) -> int:
        self.events.append(("close", mr))
        return int(self.real.pd_mr_close(mr))

    def pd_engine_close(self, native: Any) -> int:
        rc = int(self.real.pd_engine_close(native))
        self.events.append(("engine_close", rc))
        self.closed_engines.append(native)
        return rc

    def pd_wake(self, native: Any) -> int:
        if any(native == closed for closed in self.closed_engines):
            self.late_wakes += 1
            return 0
        return int(self.real.pd_wake(native))

    def closed(self, handle: Any) -> bool:
        return any(kind == "close" and value == handle.mr for kind, value in self.events)


@pytest.fixture
def binding_log(monkeypatch: pytest.MonkeyPatch) -> BindingLog:
    spy = BindingLog(progress.lib)
    monkeypatch.setattr(progress, "lib", spy)
    monkeypatch.setattr(engine_module, "lib", spy)
    return spy


_READ = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_READERR = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64)
_FI_CLASS_CQ = 14  # fabric.h's enum: UNSPEC, FABRIC, DOMAIN, EP, ..., MR, EQ, CQ
_DATA_ENTRY = 40  # struct fi_cq_data_entry: op_context, flags, len, buf, data


class FakeCqOps:
    """NAMED TEST FAULT: the engine's CQ answers through a copy of the provider's operation
    table whose ``read`` / ``readerr`` are replaced (the rest are the provider's). Installed
    and removed on the progress thread (`install`), or once it has ended (`remove`).

    Layouts read here: `struct pd_engine` (`_build.py`) starts with info, fabric, domain, cq;
    `struct fid_cq` is a `struct fid` (fclass, context, ops) followed by its `fi_ops_cq *`."""

    def __init__(
        self,
        engine: TransferEngine,
        read: Callable[[Any, int, int], int] | None = None,
        readerr: Callable[[int, int, int], int] | None = None,
    ) -> None:
        self.engine = engine
        native = int(ffi.cast("uintptr_t", engine._native))
        cq = ctypes.c_void_p.from_address(native + 3 * 8).value or 0
        assert ctypes.c_size_t.from_address(cq).value == _FI_CLASS_CQ, "not the engine's CQ"
        self._ops = ctypes.c_void_p.from_address(cq + 3 * 8)
        self._original = self._ops.value or 0
        provider_table = (ctypes.c_void_p * 8).from_address(self._original)
        self._table = (ctypes.c_void_p * 8)(*provider_table)
        self.real_read = _READ(provider_table[1])
        self._callbacks: list[Any] = []  # the C function pointers must outlive their use
        if read is not None:
            self._table[1] = self._function(_READ(lambda c, b, n: read(self, c, b, n)))
        if readerr is not None:
            self._table[3] = self._function(_READERR(readerr))

    def _function(self, callback: Any) -> int | None:
        self._callbacks.append(callback)
        return ctypes.cast(callback, ctypes.c_void_p).value

    def install(self) -> None:
        self.engine._loop.call(lambda: setattr(self._ops, "value", ctypes.addressof(self._table)))

    def remove(self) -> None:
        try:
            self.engine._loop.call(lambda: setattr(self._ops, "value", self._original))
        except EngineClosedError:  # the loop ended (or was abandoned in it): one pointer store
            self._ops.value = self._original


def _misflag_local_completions(fake: FakeCqOps, cq: Any, buf: int, count: int) -> int:
    """A provider that sets FI_REMOTE_CQ_DATA on completions of our own writes and sends."""
    n = int(fake.real_read(cq, buf, count))
    for k in range(max(n, 0)):
        flags = ctypes.c_uint64.from_address(buf + k * _DATA_ENTRY + 8)
        if flags.value & (lib.FI_WRITE | lib.FI_SEND) and not flags.value & lib.FI_RECV:
            flags.value |= lib.FI_REMOTE_CQ_DATA
    return n


def _always_an_error(_fake: FakeCqOps, _cq: Any, _buf: int, _count: int) -> int:
    return int(-lib.FI_EAVAIL)


def _unreadable_error(_cq: int, _buf: int, _flags: int) -> int:
    return -errno.EIO


# -- 1. deregister while writes from the region are queued or posted -----------------------------


def test_deregister_keeps_a_queued_writes_region_registered_until_it_ended(
    make_engine: Callable[..., TransferEngine], binding_log: BindingLog
) -> None:
    """`deregister` used to close the registration on the progress thread before a write
    queued from it was posted (commands run first in each pass): the write then went out with
    a closed registration's descriptor. Now the close waits for the write."""
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
    assert _wait_until(lambda: binding_log.closed(handle))
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
        assert _wait_until(lambda: engine.stats().progress.ops_posted > 1 or bool(errors))
        if errors:
            return False
        engine.deregister(handle)
        assert not done.is_set()  # the target is stopped: writes are still in flight
        assert not binding_log.closed(handle)
    finally:
        target.resume()
    assert _wait_until(lambda: done.is_set() or bool(errors), timeout=60)
    if errors and "stuck" in str(errors[0]):
        return False
    assert done.is_set(), errors
    assert _wait_until(lambda: binding_log.closed(handle))
    target.expect([5], 64)  # landed before the target closes (rxm crashes closing mid-stream)
    assert target.wait_for("reached")["imm"] == 5
    return True


# -- 2. close that cannot wait for the progress thread ----------------------------------------


def test_close_from_an_inline_callback_is_completed_by_the_progress_thread(
    make_engine: Callable[..., TransferEngine], binding_log: BindingLog
) -> None:
    """An inline callback runs on the progress thread; `close` there raised "cannot join
    current thread" (swallowed), leaving the callback thread and the endpoint behind for good."""
    target = make_engine()
    engine = make_engine()
    _, descriptor = target.register(np.zeros(4096, dtype=np.uint8))
    handle, _ = engine.register(np.ones(4096, dtype=np.uint8))
    target.expect_imm(7, 1, target.close, inline=True)
    engine.submit_write(handle, 0, engine.add_peer(target.address), descriptor, 0, 64, imm=7)
    assert _wait_until(lambda: not any(thread.is_alive() for thread in target.threads))
    assert target.stats().callback_errors == 0
    assert ("engine_close", 0) in binding_log.events  # freed, every fid closed cleanly
    assert target.closed_reason() == "engine is closed"
    target.close()  # nothing left to do


def test_close_that_times_out_in_a_stuck_post_completes_when_the_post_returns(
    make_engine: Callable[..., TransferEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`close(timeout)` while the progress thread is inside a provider call (NAMED TEST FAULT
    `StuckPosts`) used to return for good, leaving the callback thread and the endpoint. Now
    the progress thread completes the teardown once its call returns, and the writes it held
    end with `EngineClosedError`."""
    monkeypatch.setattr(watchdog, "_STALL_S", 600.0)  # this case is not the watchdog's
    engine = make_engine()
    stuck = StuckPosts(progress.lib, engine.threads[0])
    monkeypatch.setattr(progress, "lib", stuck)
    handle, descriptor = engine.register(np.zeros(4096, dtype=np.uint8))
    errors: list[FabricError] = []
    stuck.armed.set()
    engine.submit_write(handle, 0, engine.add_peer(engine.address), descriptor, 0, 64,
                        on_error=errors.append)  # fmt: skip
    try:
        assert stuck.entered.wait(30)
        engine.close(timeout=0.05)
        engine.close(timeout=0.05)  # still stuck: returns again, nothing is lost
        assert engine.closed_reason() == "engine is closed"
    finally:
        stuck.release.set()
    assert _wait_until(lambda: not any(thread.is_alive() for thread in engine.threads))
    assert engine._native is None  # released by the progress thread as it ended
    assert len(errors) == 1 and isinstance(errors[0], EngineClosedError)


def test_close_that_times_out_before_the_watchdog_abandons_still_ends_callbacks(
    make_engine: Callable[..., TransferEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same, but the watchdog abandons the loop after `close` gave up waiting: what it fails
    is delivered, then the callback thread ends; the endpoint is left open (abandoned)."""
    monkeypatch.setattr(watchdog, "_STALL_S", 0.3)
    monkeypatch.setattr(watchdog, "_WATCHDOG_PERIOD_S", 0.05)
    engine = make_engine(op_timeout=600.0)
    stuck = StuckPosts(progress.lib, engine.threads[0])
    monkeypatch.setattr(progress, "lib", stuck)
    handle, descriptor = engine.register(np.zeros(4096, dtype=np.uint8))
    errors: list[FabricError] = []
    stuck.armed.set()
    engine.submit_write(handle, 0, engine.add_peer(engine.address), descriptor, 0, 64,
                        on_error=errors.append)  # fmt: skip
    try:
        assert stuck.entered.wait(30)
        engine.close(timeout=0.0)
        assert _wait_until(lambda: not engine.threads[1].is_alive())  # the callback thread
        assert len(errors) == 1 and isinstance(errors[0], PeerFailedError), errors
    finally:
        stuck.release.set()
    assert _wait_until(lambda: not engine.threads[0].is_alive())
    assert engine._native is not None  # abandoned: left open by design


# -- 3. malformed messages ---------------------------------------------------------------------


def _send_frame(sender: TransferEngine, peer: Any, frame: bytes, sent: threading.Event) -> None:
    """A foreign sender: ``frame`` goes out through the real send path, as is (no framing)."""
    job = Job(job_id=sender._loop.new_job_id(), kind=SEND, peer=peer, total=1,
              deadline=time.monotonic() + 30, on_done=sent.set, on_error=None, payload=frame)  # fmt: skip
    sender._loop.enqueue(job, 10.0)


def test_malformed_messages_are_dropped_and_counted_and_the_engine_goes_on(
    make_engine: Callable[..., TransferEngine],
) -> None:
    """A 1-byte frame made `struct.unpack` raise in the progress thread: the engine shut down
    and every peer's operations failed. Bad frames are now dropped and counted."""
    receiver = make_engine()
    sender = make_engine()
    peer = sender.add_peer(receiver.address)
    frames = [b"\x01", struct.pack("<H", 200) + b"short", struct.pack("<H", 0) + b"no source"]
    for frame in frames:
        sent = threading.Event()
        _send_frame(sender, peer, frame, sent)
        assert sent.wait(30)
    sender.submit_send(peer, b"after")
    message = receiver.recv(timeout=30)
    assert message == Message(sender.address, b"after")
    stats = receiver.stats().progress
    assert (stats.messages_malformed, stats.messages_received) == (len(frames), 1)
    assert receiver.closed_reason() is None


# -- 4. jobs starved of context slots -------------------------------------------------------------


def test_a_job_starved_of_op_slots_ends_alone_without_failing_its_peer(
    make_engine: Callable[..., TransferEngine], make_target: Callable[[int], RemoteTarget]
) -> None:
    """Writes to a stopped target hold every context slot; a write to a healthy peer then
    cannot be posted. At its deadline it used to fail the healthy peer ("peer unreachable or
    dead"); now it ends alone in `TransferError` naming the shortage."""
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
        assert _wait_until(lambda: lib.pd_engine_free_slots(engine._native) == 0 or bool(outcome))
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


# -- 5. a completion flagged FI_REMOTE_CQ_DATA on a local operation --------------------------------


def test_local_completions_flagged_as_remote_data_stay_local(
    make_engine: Callable[..., TransferEngine],
) -> None:
    """With FI_REMOTE_CQ_DATA set on a completion of our own write (NAMED TEST FAULT
    `FakeCqOps`), the write used to count as an arrival and its context slot was reposted
    as a receive buffer at a wild address. The flag is now trusted only for receive slots."""
    target = make_engine()
    engine = make_engine()
    _, descriptor = target.register(np.zeros(4096, dtype=np.uint8))
    handle, _ = engine.register(np.ones(4096, dtype=np.uint8))
    peer = engine.add_peer(target.address)
    fake = FakeCqOps(engine, read=_misflag_local_completions)
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


# -- 6. a failing error read, a late wake, a region left at a dead loop, poll waits --------------


def test_an_unreadable_cq_error_ends_the_loop_instead_of_spinning(
    make_engine: Callable[..., TransferEngine], binding_log: BindingLog
) -> None:
    """fi_cq_read reports an error entry that fi_cq_readerr cannot return (NAMED TEST FAULT
    `FakeCqOps`): pd_poll looped on it forever, until the watchdog abandoned the engine. Now
    the failure reaches the loop, which ends its operations and stops.

    The loop was sleeping when it failed (idle_spin_us=0): its sleeping flag used to stay
    set, so a later wake wrote to the freed engine. And a region deregistered after the loop
    died used to be dropped unclosed (the domain then refused to close: EBUSY)."""
    engine = make_engine(idle_spin_us=0)
    handle, _ = engine.register(np.ones(4096, dtype=np.uint8))
    fake = FakeCqOps(engine, read=_always_an_error, readerr=_unreadable_error)
    fake.install()
    try:
        assert _wait_until(lambda: not engine._loop.thread.is_alive())
        assert engine.closed_reason() == "engine is closed"  # ended, not abandoned as stuck
    finally:
        fake.remove()
    with pytest.raises(EngineClosedError):
        engine.deregister(handle)
    engine.close()
    assert binding_log.closed(handle)
    assert ("engine_close", 0) in binding_log.events
    engine._loop._wake()  # e.g. a `wakes_deferred` block ending after the close
    assert binding_log.late_wakes == 0


def test_poll_waits_the_watchdog_would_take_for_a_stall_are_refused(provider: str) -> None:
    """An idle engine waits `idle_wait_us` inside one native call; longer than the watchdog's
    stall threshold, the watchdog abandoned the idle engine."""
    for options in ({"idle_wait_us": MAX_POLL_US + 1}, {"idle_wait_us": 5_000_000},
                    {"spin_us": MAX_POLL_US + 1}, {"idle_wait_us": -1}):  # fmt: skip
        with pytest.raises(ValueError, match="watchdog"):
            TransferEngine(provider, **options)
    TransferEngine(provider, idle_wait_us=MAX_POLL_US).close()
