"""Review fixes of the decoder's KV messenger and the fabric counters it relies on.

1. A counter that the fabric's close disarmed (`fail_all`: watchdog abandon, shutdown) is no
   proof that its writes landed: the transfer's pages stay held.
2. An imm handed out again after its generation wrapped starts from zero in the fabric
   (`TransferEngine.reset_imm`): its writes landing before the arming count, not dropped as
   late ones of the old transfer's tombstone; the messenger keeps the quarantine's counts itself
   (`TransferEngine.take_imm_arrivals`), so an evicted tombstone loses nothing it had taken.
3. A `PrefillAccepted` handled after the fabric closed fails its request; the step loop lives.

Unit tests of the counters and the slot table, two real engines over ``tcp;ofi_rxm``, and real
workers on the tiny preset (the abandoned fabric as in `test_fabric_abandoned.py`: the NAMED
TEST FAULT `tests.fabric.harness.StuckPosts`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from tests.engine.engine_helpers import prompts_of_lengths
from tests.fabric.harness import StuckPosts, close_engine
from tests.kv.harness import decode_pool_full, wait_until
from workers.engine.config import EngineConfig
from workers.engine.errors import EngineClosedError
from workers.engine.sampling_params import SamplingParams
from workers.fabric import ImmError, TransferEngine, progress, watchdog
from workers.fabric.counters import ImmCounters
from workers.kv import decode_messenger
from workers.kv.decode_messenger import DecodeMessengerConfig
from workers.kv.imm import ImmLayout, SlotTable
from workers.kv.worker import DecodeWorker, PrefillWorker

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


def _pair(
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    config: DecodeMessengerConfig,
) -> tuple[PrefillWorker, DecodeWorker]:
    """Workers on the tiny preset; a watchdog that abandons a fabric within ~0.5 s; one page
    per prefill pass, so a long prompt's transfer is mid-way when the tests act."""
    monkeypatch.setattr(watchdog, "_STALL_S", 0.5)
    monkeypatch.setattr(watchdog, "_WATCHDOG_PERIOD_S", 0.05)
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
def test_an_armed_transfer_keeps_its_pages_when_the_decoder_fabric_is_abandoned(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 1: without coalescing the decoder arms at once; with writes landed, the fabric
    is abandoned and `fail_all` disarms the counter. That is no fire: the pages stay held."""
    config = DecodeMessengerConfig(
        transfer_timeout_s=3600.0, drain_interval_s=DRAIN_S, coalesce_pages=False
    )
    prefill, decode = _pair(tiny_model_dir, monkeypatch, config)
    prefill.fabric.op_timeout = 2.0  # its writes into the abandoned decoder end
    stuck = StuckPosts(progress.lib, decode.fabric.threads[0])
    monkeypatch.setattr(progress, "lib", stuck)
    try:
        armed_prompt, trigger_prompt = prompts_of_lengths([1600, 40], seed=11)
        armed = decode.submit("armed", armed_prompt, GREEDY, prefill.endpoint())

        def landed() -> bool:
            now = decode.transfer_progress("armed")
            assert now is not None, "the transfer ended before the fault"
            return now[0] > 0 and now[1] is not None  # armed: the decoder knows the count

        wait_until(landed, what="first write of the armed transfer")
        # The next PrefillRequest is the post that never returns: the fabric is abandoned.
        stuck.armed.set()
        trigger = decode.submit("trigger", trigger_prompt, GREEDY, prefill.endpoint())
        assert stuck.entered.wait(WAIT_S)
        wait_until(lambda: decode.fabric.closed_reason() is not None, what="fabric abandoned")

        held: set[int] = set()
        for request_id, stream in (("armed", armed), ("trigger", trigger)):
            tokens, final = stream.result(WAIT_S)
            assert tokens == [] and final.error is not None
            assert "KV fabric unusable" in final.error
            record = decode.transfer_stats(request_id) or {}
            assert record.get("state") == "failed", record
            held |= set(record["page_ids"])
        time.sleep(10 * DRAIN_S)
        for request_id in ("armed", "trigger"):
            assert "quarantine_release" not in (decode.transfer_stats(request_id) or {})
        assert decode.engine.block_manager.num_pinned_pages == len(held) > 0
    finally:
        stuck.release.set()
        decode.close()
        prefill.close(drain_timeout_s=2.0)


@pytest.mark.slow
def test_a_prefill_accepted_handled_after_the_fabric_closed_fails_its_request(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 3: the `PrefillAccepted` is in the decoder's inbox when its fabric is
    abandoned (the step thread is held meanwhile); arming then raises, which must fail the
    request, not the step loop."""
    config = DecodeMessengerConfig(transfer_timeout_s=3600.0, drain_interval_s=DRAIN_S)
    prefill, decode = _pair(tiny_model_dir, monkeypatch, config)
    prefill.fabric.op_timeout = 2.0
    stuck = StuckPosts(progress.lib, decode.fabric.threads[0])
    monkeypatch.setattr(progress, "lib", stuck)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait(WAIT_S)

    holder = threading.Thread(target=decode._loop.call, args=(hold,))
    try:
        (prompt,) = prompts_of_lengths([400], seed=12)
        stream = decode.submit("r", prompt, GREEDY, prefill.endpoint())
        wait_until(lambda: (decode.transfer_progress("r") or (0, 0))[0] > 0, what="a write")
        holder.start()
        assert held.wait(WAIT_S)
        inbox = decode.messenger._inbox
        wait_until(lambda: inbox.qsize() >= 1, timeout=WAIT_S, what="PrefillAccepted queued")
        stuck.armed.set()  # a send from here is the post that never returns
        decode.fabric.submit_send(decode.fabric.add_peer(prefill.endpoint().address), b"x")
        assert stuck.entered.wait(WAIT_S)
        wait_until(lambda: decode.fabric.closed_reason() is not None, what="fabric abandoned")
        release.set()
        holder.join(WAIT_S)

        tokens, final = stream.result(WAIT_S)
        assert tokens == [] and final.error is not None
        assert final.error.startswith("KV fabric unusable"), final.error  # not a dead loop
        record = decode.transfer_stats("r") or {}  # the step loop still answers
        assert record.get("state") == "failed", record
        pinned = decode.engine.block_manager.num_pinned_pages
        if "quarantine_release" in record:  # every write had landed: nothing can come
            assert record["num_writes_landed"] == record["num_writes_expected"], record
            assert pinned == 0
        else:
            assert pinned == len(record["page_ids"]) > 0
        with pytest.raises(EngineClosedError, match="KV fabric unusable"):
            decode.state()
    finally:
        release.set()
        if holder.is_alive():
            holder.join(WAIT_S)
        stuck.release.set()
        decode.close()
        prefill.close(drain_timeout_s=2.0)


@pytest.mark.slow
def test_a_reissued_imm_counts_the_writes_that_land_before_its_arming(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 2 end to end: one slot and one generation bit, so the imm of an aborted
    transfer comes back two transfers later, with its tombstone still in the fabric. The new
    transfer's early writes (coalescing: before `PrefillAccepted`) must count."""
    monkeypatch.setattr(
        decode_messenger, "ImmLayout", partial(ImmLayout, slot_bits=1, generation_bits=1)
    )
    config = DecodeMessengerConfig(
        transfer_timeout_s=20.0, drain_interval_s=DRAIN_S, max_transfers=1
    )
    prefill, decode = _pair(tiny_model_dir, monkeypatch, config)
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
