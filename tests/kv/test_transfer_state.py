from __future__ import annotations

import pytest

from workers.kv.errors import IllegalTransitionError
from workers.kv.transfer_state import (
    DECODE_TRANSITIONS,
    PREFILL_TRANSITIONS,
    DecodeState,
    DecodeTransfer,
    PrefillState,
    PrefillTransfer,
    TransferTable,
)


def decode(expected: int = 3) -> DecodeTransfer:
    return DecodeTransfer(
        "r1", imm=7, page_ids=(1, 2), num_writes_expected=expected, deadline_s=10.0, now_s=0.0
    )


def test_decode_happy_path_records_times() -> None:
    t = decode()
    t.advance(DecodeState.REQUESTED, 1.0)
    assert t.record_writes(1, 2.0) is False and t.state is DecodeState.RECEIVING
    assert t.record_writes(2, 3.0) is True and t.state is DecodeState.READY
    assert t.is_terminal and t.entered_at(DecodeState.REQUESTED) == 1.0
    assert t.stats.first_completion_s == 2.0 and t.stats.kv_ready_s == 3.0
    assert t.stats.num_writes == 3
    t.stats.forward_end_s = 2.5
    assert t.stats.exposed_transfer_s == pytest.approx(0.5)


def test_decode_all_writes_in_one_batch_skips_receiving() -> None:
    t = decode(2)
    t.advance(DecodeState.REQUESTED, 1.0)
    assert t.record_writes(2, 1.5)
    assert [s for s, _ in t.history] == [
        DecodeState.ALLOCATED,
        DecodeState.REQUESTED,
        DecodeState.READY,
    ]


def test_decode_counter_fired() -> None:
    t = decode(5)
    with pytest.raises(IllegalTransitionError):
        t.count_reached(0.5)
    t.advance(DecodeState.REQUESTED, 1.0)
    t.count_reached(2.0)
    assert t.state is DecodeState.READY and t.num_writes_seen == t.stats.num_writes == 5
    assert t.stats.kv_ready_s == 2.0


def test_decode_too_many_writes_fail_the_transfer() -> None:
    t = decode(2)
    t.advance(DecodeState.REQUESTED, 1.0)
    assert t.record_writes(3, 1.5) is False
    assert t.state is DecodeState.FAILED and "expected 2" in (t.failure_reason or "")


def test_decode_illegal_transitions_raise() -> None:
    t = decode()
    with pytest.raises(IllegalTransitionError):
        t.advance(DecodeState.RECEIVING, 1.0)
    with pytest.raises(IllegalTransitionError):
        t.record_writes(1, 1.0)  # not requested yet
    t.advance(DecodeState.REQUESTED, 1.0)
    with pytest.raises(IllegalTransitionError, match="READY with 0"):
        t.advance(DecodeState.READY, 1.0)
    assert t.is_expired(10.0) and not t.is_expired(9.9)
    t.fail("deadline", 10.0)
    assert not t.is_expired(11.0)
    for state in DecodeState:
        with pytest.raises(IllegalTransitionError):
            t.advance(state, 11.0)


def test_every_table_edge_and_non_edge() -> None:
    for table, states in ((DECODE_TRANSITIONS, DecodeState), (PREFILL_TRANSITIONS, PrefillState)):
        assert set(table) == set(states)
        for source, targets in table.items():
            assert targets <= set(states) and source not in targets


def prefill(planned: int = 2) -> PrefillTransfer:
    return PrefillTransfer("r1", imm=7, num_writes_planned=planned, now_s=0.0)


def test_prefill_happy_path() -> None:
    t = prefill()
    with pytest.raises(IllegalTransitionError, match="QUEUED"):
        t.record_submit(10, 0.5)
    t.advance(PrefillState.PREFILLING, 1.0)
    t.record_submit(100, 1.1)
    t.stats.forward_end_s = 1.2
    t.advance(PrefillState.WRITING, 1.2)
    t.record_submit(50, 1.3)
    with pytest.raises(IllegalTransitionError, match="more writes"):
        t.record_submit(1, 1.3)
    t.record_completion(1.4)
    assert not t.finish_if_drained(1.4)
    with pytest.raises(IllegalTransitionError, match="in flight"):
        t.advance(PrefillState.DONE, 1.4)
    t.record_completion(1.5)
    assert t.finish_if_drained(1.5) and t.state is PrefillState.DONE
    assert (t.stats.num_bytes, t.stats.num_writes) == (150, 2)
    assert (t.stats.first_submit_s, t.stats.last_submit_s) == (1.1, 1.3)
    assert t.stats.exposed_transfer_estimate_s == pytest.approx(0.3)
    with pytest.raises(IllegalTransitionError, match="without a write"):
        t.record_completion(1.6)


def test_prefill_abort_drains_in_flight_writes_before_cancelling() -> None:
    t = prefill(4)
    t.advance(PrefillState.PREFILLING, 1.0)
    t.record_submit(10, 1.0)
    t.stop("aborted by decoder", 1.1, failed=False)
    assert t.state is PrefillState.DRAINING and not t.accepts_writes
    with pytest.raises(IllegalTransitionError):
        t.record_submit(10, 1.2)
    assert not t.finish_if_drained(1.2)
    t.record_completion(1.3)
    assert t.finish_if_drained(1.3) and t.state is PrefillState.CANCELLED
    assert t.num_writes_submitted == 1  # what AbortAcknowledged reports


def test_prefill_failed_write_fails_the_transfer_after_draining() -> None:
    t = prefill(4)
    t.advance(PrefillState.PREFILLING, 1.0)
    t.record_submit(10, 1.0)
    t.record_submit(10, 1.0)
    t.record_completion(1.1, ok=False)
    assert t.state is PrefillState.DRAINING and t.failure_reason == "write failed"
    t.record_completion(1.2)
    assert t.finish_if_drained(1.2) and t.state is PrefillState.FAILED


def test_prefill_writes_never_posted_are_taken_back_out_of_the_count() -> None:
    t = prefill(4)
    t.advance(PrefillState.PREFILLING, 1.0)
    t.record_submit(10, 1.0, count=2)  # posted
    t.record_submit(30, 1.0, count=2)  # the fabric then refused these at once
    t.stop("aborted by decoder", 1.1, failed=False)  # meanwhile: all four look in flight
    assert t.state is PrefillState.DRAINING and t.num_writes_in_flight == 4
    t.unrecord_submit(30, count=2)
    assert t.num_writes_submitted == 2 and t.stats.num_bytes == 10  # what acks report now
    with pytest.raises(IllegalTransitionError, match="taken back"):
        t.unrecord_submit(10, count=3)  # more than in flight: never below what was posted
    t.record_completion(1.2, count=2)
    assert t.finish_if_drained(1.2) and t.state is PrefillState.CANCELLED
    assert t.num_writes_submitted == 2


def test_prefill_stop_without_writes_is_terminal_at_once() -> None:
    t = prefill()
    t.stop("no pages", 0.5, failed=True)
    assert t.state is PrefillState.FAILED
    q = prefill()
    q.advance(PrefillState.PREFILLING, 0.1)
    with pytest.raises(IllegalTransitionError, match="through stop"):
        q.advance(PrefillState.DRAINING, 0.2)
    with pytest.raises(IllegalTransitionError):
        prefill().advance(PrefillState.WRITING, 0.1)
    with pytest.raises(ValueError):
        prefill(0)


def test_transfer_table_is_keyed_by_request_id() -> None:
    table: TransferTable[PrefillTransfer] = TransferTable()
    a, b = PrefillTransfer("a", 1, 1, 0.0), PrefillTransfer("b", 2, 1, 0.0)
    table.add(a)
    table.add(b)
    with pytest.raises(KeyError):
        table.add(PrefillTransfer("a", 3, 1, 0.0))
    b.advance(PrefillState.PREFILLING, 1.0)
    assert table.in_state(PrefillState.QUEUED) == [a] and "b" in table and len(table) == 2
    assert table.pop("a") is a and table.get("a") is None and list(table) == [b]
