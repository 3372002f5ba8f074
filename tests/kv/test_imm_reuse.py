"""An imm value handed out again (a slot's generation wrapped) counts only its own writes.

The fabric's counter of a reused imm starts from zero (`TransferEngine.reset_imm`): its writes
landing before the arming count, and are not dropped as late ones of the old transfer's
tombstone. The decoder keeps the quarantine's counts itself (`TransferEngine.take_imm_arrivals`),
so an evicted tombstone loses nothing it had taken.

Unit tests of the counters and the slot table, two real engines over ``tcp;ofi_rxm``, and real
workers on the tiny preset.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from tests.engine.engine_helpers import prompts_of_lengths
from tests.fabric.harness import close_engine
from tests.kv.harness import decode_pool_full
from tests.waiting import wait_until
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams
from workers.fabric import ImmError, TransferEngine
from workers.fabric.counters import ImmCounters
from workers.kv import decode_messenger
from workers.kv.decode_messenger import DecodeMessengerConfig
from workers.kv.imm import ImmLayout, SlotTable
from workers.service.kv_worker import DecodeWorker, PrefillWorker

PROVIDER = "tcp;ofi_rxm"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
DECODE_PAGES = 200
PREFILL_PAGES = 200
WAIT_S = 60.0
DRAIN_S = 0.2

# -- counters (unit) -------------------------------------------------------------------------


def test_reset_forgets_a_tombstone_and_stray_arrivals() -> None:
    counters = ImmCounters()
    counters.record({7: 2})
    counters.cancel(7)  # tombstoned with 2
    counters.record({7: 1})
    assert counters.arrived(7) == 3 and counters.stats().late_dropped == 1
    counters.reset(7)
    assert counters.arrived(7) == 0
    counters.record({7: 4})  # early writes of the value's new use: buffered, not late
    assert counters.stats().late_dropped == 1 and counters.arrived(7) == 4
    fired: list[int] = []
    for callback, args in counters.expect(7, 5, partial(fired.append, 7)):
        callback(*args)
    for callback, args in counters.record({7: 1}):
        callback(*args)
    assert fired == [7]
    counters.record({8: 3})
    counters.reset(8)  # buffered arrivals only
    assert counters.arrived(8) == 0 and counters.stats().unexpected_values == 0
    counters.expect(9, 1, lambda: None)
    with pytest.raises(ImmError):
        counters.reset(9)  # armed: not the caller's to forget
    with pytest.raises(ImmError):
        counters.take_arrivals(9)


def test_taken_arrivals_survive_an_evicted_tombstone() -> None:
    counters = ImmCounters(max_cancelled=2)
    counters.record({1: 3})
    counters.cancel(1)
    total = counters.take_arrivals(1)
    assert total == 3 and counters.arrived(1) == 0
    counters.record({1: 2})  # late: still tombstoned, counted for the next take
    assert counters.stats().late_dropped == 2
    counters.cancel(2)
    total += counters.take_arrivals(1)  # refreshed: now newer than 2's tombstone
    counters.cancel(3)  # evicts 2, the oldest, not the watched 1
    counters.record({1: 1, 2: 1})
    assert counters.stats().late_dropped == 3 and counters.arrived(2) == 1  # 2: buffered
    total += counters.take_arrivals(1)
    assert total == 6
    counters.cancel(4)
    counters.cancel(5)  # 1 evicted after all: what was taken is the caller's, later ones buffer
    counters.record({1: 4})
    total += counters.take_arrivals(1)
    assert total == 10 and counters.take_arrivals(1) == 0


def test_a_wrapped_imm_counts_the_writes_that_land_before_arming() -> None:
    """The messenger's order with a 1-slot, 1-generation-bit table: a transfer fails (counter
    cancelled, slot parked, recycled once drained), the generation wraps, the same imm is
    handed out again and its first writes land before `PrefillAccepted` arms the counter."""
    slots, counters = SlotTable(ImmLayout(slot_bits=1, generation_bits=1), 1), ImmCounters()
    failed = slots.allocate("failed")
    counters.reset(failed)
    counters.record({failed: 3})
    counters.cancel(failed)
    slots.release(failed, drained=False)
    assert counters.take_arrivals(failed) == 3
    counters.record({failed: 1})  # its last write, then the quarantine lets the slot go
    assert counters.take_arrivals(failed) == 1
    slots.recycle(failed)
    done = slots.allocate("done")  # the next generation: completes normally
    assert done != failed
    counters.reset(done)
    counters.expect(done, 1, lambda: None)
    counters.record({done: 1})
    slots.release(done)
    again = slots.allocate("again")
    assert again == failed  # wrapped: the old tombstone is still there
    late = counters.stats().late_dropped  # the failed transfer's last write
    counters.reset(again)
    counters.record({again: 40})  # before PrefillAccepted
    fired: list[int] = []
    assert counters.expect(again, 50, partial(fired.append, again)) == []
    for callback, args in counters.record({again: 10}):
        callback(*args)
    assert fired == [again] and counters.stats().late_dropped == late


# -- two real engines --------------------------------------------------------------------------


@pytest.fixture
def engines() -> Iterator[tuple[TransferEngine, TransferEngine]]:
    sender, receiver = TransferEngine(PROVIDER), TransferEngine(PROVIDER)
    try:
        yield sender, receiver
    finally:
        close_engine(sender)
        close_engine(receiver)


@pytest.mark.timeout(120)
def test_reset_and_take_on_a_real_engine(engines: tuple[TransferEngine, TransferEngine]) -> None:
    sender, receiver = engines
    source = np.arange(4096, dtype=np.uint8)
    target = np.zeros(4096, dtype=np.uint8)
    handle, _ = sender.register(source)
    _, descriptor = receiver.register(target)
    peer = sender.add_peer(receiver.address)
    imm = 0x5

    def write(count: int) -> None:
        done = threading.Semaphore(0)
        rows = np.array([[i * 16, i * 16, 16] for i in range(count)], dtype=np.int64)
        sender.submit_writes(handle, peer, descriptor, rows, imm=imm, on_done=done.release)
        assert done.acquire(timeout=30)

    def landed(count: int) -> None:
        wait_until(lambda: receiver.imm_arrivals(imm) == count, what=f"{count} arrivals")

    write(2)
    landed(2)  # buffered: not armed yet
    assert receiver.cancel_imm(imm)
    write(1)
    landed(3)  # a late write, counted under the tombstone
    assert receiver.take_imm_arrivals(imm) == 3 and receiver.imm_arrivals(imm) == 0
    late = receiver.stats().imm.late_dropped
    receiver.reset_imm(imm)  # handed out anew
    write(2)  # early writes of the new use: buffered, not dropped as late
    landed(2)
    reached = threading.Event()
    receiver.expect_imm(imm, 3, reached.set)
    write(1)
    assert reached.wait(30)
    assert receiver.stats().imm.late_dropped == late


# -- real workers ------------------------------------------------------------------------------


def _pair(model_dir: Path, config: DecodeMessengerConfig) -> tuple[PrefillWorker, DecodeWorker]:
    """Workers on the tiny preset; one page per prefill pass, so a long prompt's transfer is
    mid-way when the test acts."""
    prefill = PrefillWorker(
        model_dir,
        EngineConfig(num_pages=PREFILL_PAGES, max_num_batched_tokens=16),
        provider=PROVIDER,
    )
    try:
        decode = DecodeWorker(
            model_dir,
            EngineConfig(num_pages=DECODE_PAGES),
            provider=PROVIDER,
            messenger_config=config,
        )
    except BaseException:
        prefill.close()
        raise
    return prefill, decode


@pytest.mark.slow
def test_a_reissued_imm_counts_the_writes_that_land_before_its_arming(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end: one slot and one generation bit, so the imm of an aborted transfer comes
    back two transfers later, with its tombstone still in the fabric. The new transfer's early
    writes (coalescing: before `PrefillAccepted`) must count."""
    monkeypatch.setattr(
        decode_messenger, "ImmLayout", partial(ImmLayout, slot_bits=1, generation_bits=1)
    )
    config = DecodeMessengerConfig(
        transfer_timeout_s=20.0, drain_interval_s=DRAIN_S, max_transfers=1
    )
    prefill, decode = _pair(tiny_model_dir, config)
    try:
        aborted_prompt, short_prompt, reissued_prompt = prompts_of_lengths([800, 40, 400], seed=13)
        endpoint = prefill.endpoint()
        decode.submit("aborted", aborted_prompt, GREEDY, endpoint)
        wait_until(lambda: (decode.transfer_progress("aborted") or (0, 0))[0] > 0, what="write")
        assert decode.abort("aborted")

        def drained() -> bool:
            return "quarantine_release" in (decode.transfer_stats("aborted") or {})

        wait_until(drained, timeout=WAIT_S, what="aborted transfer drained (slot recycled)")
        aborted = decode.transfer_stats("aborted") or {}
        assert aborted["quarantine_release"] == "drained"
        assert aborted["num_writes_landed"] > 0  # counted by the messenger across polls

        for request_id, prompt in (("short", short_prompt), ("reissued", reissued_prompt)):
            tokens, final = decode.submit(request_id, prompt, GREEDY, endpoint).result(WAIT_S)
            assert final.error is None, final
            assert len(tokens) == GREEDY.max_tokens
        assert (decode.transfer_stats("reissued") or {})["imm"] == aborted["imm"]
        assert (decode.transfer_stats("short") or {})["imm"] != aborted["imm"]
        wait_until(lambda: decode_pool_full(decode, DECODE_PAGES), what="decode pool full")
    finally:
        decode.close()
        prefill.close(drain_timeout_s=2.0)
