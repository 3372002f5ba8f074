"""Two-sided control messages: complete and in submission order per peer, after the counters
of writes that landed before them, and a malformed frame costs only itself."""

from __future__ import annotations

import struct
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tests.fabric.harness import Sender
from tests.waiting import wait_until
from workers.fabric import Message, PeerHandle, TransferEngine
from workers.fabric.jobs import SEND, Job

NUM_MESSAGES = 10_000
pytestmark = pytest.mark.timeout(150)


def test_ten_thousand_messages_per_peer_in_order(
    provider: str, make_engine: Callable[..., TransferEngine]
) -> None:
    engine = make_engine()
    received: dict[bytes, list[int]] = defaultdict(list)
    all_arrived = threading.Event()

    def on_message(message: Message) -> None:
        sequence = int.from_bytes(message.payload[:4], "little")
        assert message.payload == sequence.to_bytes(4, "little") * 4
        received[message.source].append(sequence)
        if sum(len(v) for v in received.values()) == 2 * NUM_MESSAGES:
            all_arrived.set()

    engine.on_message(on_message)
    senders = [Sender(provider, engine.address, NUM_MESSAGES) for _ in range(2)]
    try:
        reports = [sender.submitted() for sender in senders]
        assert all(not report["errors"] for report in reports)
        assert all_arrived.wait(120), {k.hex(): len(v) for k, v in received.items()}
    finally:
        codes = [sender.close() for sender in senders]
    assert codes == [0, 0]
    assert {bytes.fromhex(report["address"]) for report in reports} == set(received)
    for sequences in received.values():
        assert sequences == list(range(NUM_MESSAGES))
    assert engine.stats().callback_errors == 0


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
        # The target goes idle (sleeps on its CQ): write and message then land in one drain.
        sleeps = target.stats().progress.sleeps
        wait_until(lambda sleeps=sleeps: target.stats().progress.sleeps > sleeps, what="idle")
        with sender.wakes_deferred():
            sender.submit_write(handle, 0, peer, descriptor, 0, 64, imm=index)
            sender.submit_send(peer, str(index).encode())
        assert got.acquire(timeout=30)
    target.close()  # runs every queued callback
    late = [i for i in range(1, rounds + 1) if log.index(("message", i)) < log.index(("imm", i))]
    assert late == []


def _send_frame(
    sender: TransferEngine, peer: PeerHandle, frame: bytes, sent: threading.Event
) -> None:
    """A foreign sender: ``frame`` goes out through the real send path, as is (no framing)."""
    job = Job(job_id=sender._loop.new_job_id(), kind=SEND, peer=peer, total=1,
              deadline=time.monotonic() + 30, on_done=sent.set, on_error=None, payload=frame)  # fmt: skip
    sender._loop.enqueue(job, 10.0)


def test_malformed_messages_are_dropped_and_counted_and_the_engine_goes_on(
    make_engine: Callable[..., TransferEngine],
) -> None:
    """Frames too short for their header or source (a 1-byte one would make `struct.unpack`
    raise in the progress thread, failing every peer's operations) are dropped and counted."""
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
