"""Two-sided control messages: complete and in submission order per peer."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable

import pytest

from tests.fabric.harness import Sender
from workers.fabric import Message, TransferEngine

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
