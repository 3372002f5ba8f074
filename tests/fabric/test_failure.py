"""A dead or unreachable peer fails its operations, and only its operations."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.fabric.harness import RemoteTarget
from workers.fabric import (
    AddressError,
    FabricError,
    MessageTooLargeError,
    PeerFailedError,
    TransferEngine,
    TransferError,
)

MIB = 1 << 20
pytestmark = pytest.mark.timeout(120)


def test_killed_peer_fails_its_writes_and_others_keep_working(
    make_engine: Callable[..., TransferEngine], make_target: Callable[[int], RemoteTarget]
) -> None:
    victim = make_target(8 * MIB)
    healthy = make_target(MIB)
    engine = make_engine(op_timeout=3.0)
    handle, _ = engine.register(np.ones(8 * MIB, dtype=np.uint8))
    victim_peer = engine.add_peer(victim.address)
    healthy_peer = engine.add_peer(healthy.address)

    done = threading.Semaphore(0)
    outcomes: list[str] = []
    errors: list[FabricError] = []
    lock = threading.Lock()

    def on_done() -> None:
        with lock:
            outcomes.append("done")
        done.release()

    def on_error(error: FabricError) -> None:
        with lock:
            outcomes.append("error")
            errors.append(error)
        done.release()

    submitted = 0
    for index in range(200):
        if index == 40:
            for _ in range(10):  # the stream is flowing before the kill
                assert done.acquire(timeout=30)
            victim.kill()
        try:
            engine.submit_write(handle, 0, victim_peer, victim.descriptor, 0, MIB, imm=1,
                                on_done=on_done, on_error=on_error)  # fmt: skip
            submitted += 1
        except PeerFailedError:
            break  # the engine already knows: later submissions are refused at once
    for _ in range(submitted - 10):
        assert done.acquire(timeout=60), "an operation to the dead peer never ended"
    assert len(outcomes) == submitted
    assert errors and all(isinstance(error, PeerFailedError) for error in errors)
    assert all(str(victim_peer.name) in str(error) for error in errors)
    with pytest.raises(PeerFailedError):
        engine.submit_write(handle, 0, victim_peer, victim.descriptor, 0, 16, imm=1)

    # Another peer is still served: its target counts every write (the proof of delivery).
    healthy.expect([9], 4)
    healthy_outcomes: list[object] = []
    finished = threading.Semaphore(0)
    for _ in range(4):
        engine.submit_write(
            handle, 0, healthy_peer, healthy.descriptor, 0, MIB, imm=9,
            on_done=lambda: (healthy_outcomes.append("done"), finished.release()),
            on_error=lambda error: (healthy_outcomes.append(error), finished.release()),
        )  # fmt: skip
    assert healthy.wait_for("reached")["imm"] == 9
    for _ in range(4):
        assert finished.acquire(timeout=60)
    if engine.provider == "shm":
        # shm completes transmits in order per endpoint, so the dead peer's ops hold back the
        # initiator-side completions; they end in a TransferError naming the blocker, and the
        # healthy peer is not condemned.
        assert all(
            outcome == "done"
            or (isinstance(outcome, TransferError) and victim_peer.name in str(outcome))
            for outcome in healthy_outcomes
        ), healthy_outcomes
    else:
        assert healthy_outcomes == ["done"] * 4
    engine.submit_write(handle, 0, healthy_peer, healthy.descriptor, 0, 16, imm=10)


def _unreachable_address(engine: TransferEngine) -> bytes:
    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return engine.address[:2] + port.to_bytes(2, "big") + engine.address[4:]


def test_unreachable_and_garbage_addresses_fail_clearly(
    make_engine: Callable[..., TransferEngine],
) -> None:
    engine = make_engine(op_timeout=1.0)
    for garbage in (b"", b"garbage", b"\x00" * 16, b"x" * 1000):
        with pytest.raises(AddressError):
            engine.add_peer(garbage)
    handle, descriptor = engine.register(np.zeros(4096, dtype=np.uint8))
    if engine.provider == "shm":
        with pytest.raises(AddressError, match="no shm endpoint"):
            engine.add_peer(b"fi_shm://999999:0:0\x00")
        # A name whose region exists but whose process is gone: failed by the deadline.
        stale = Path("/dev/shm/999999:0:0")
        stale.write_bytes(b"")
        try:
            peer = engine.add_peer(b"fi_shm://999999:0:0\x00")
        finally:
            stale.unlink()
    else:
        peer = engine.add_peer(_unreachable_address(engine))
    failed = threading.Event()
    errors: list[FabricError] = []
    started = time.monotonic()
    engine.submit_write(handle, 0, peer, descriptor, 0, 64, imm=1,
                        on_error=lambda error: (errors.append(error), failed.set()))  # fmt: skip
    assert failed.wait(30)
    assert isinstance(errors[0], PeerFailedError) and peer.name in str(errors[0])
    assert time.monotonic() - started < 30
    # The engine still serves others: a loopback write to itself completes.
    self_peer = engine.add_peer(engine.address)
    reached = threading.Event()
    engine.expect_imm(2, 1, reached.set)
    engine.submit_write(handle, 0, self_peer, descriptor, 100, 64, imm=2)
    assert reached.wait(30)


def test_oversize_message_refused(make_engine: Callable[..., TransferEngine]) -> None:
    engine = make_engine(max_message_bytes=1024)
    peer = engine.add_peer(engine.address)
    with pytest.raises(MessageTooLargeError):
        engine.submit_send(peer, b"x" * 1025)
    engine.submit_send(peer, b"y" * 1024)
    assert engine.recv(timeout=30).payload == b"y" * 1024
