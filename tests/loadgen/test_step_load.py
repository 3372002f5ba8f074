"""Each role's busy share in a sweep's run, from the workers' cumulative step traces."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.loadgen.step_load import LOAD_KEYS, TraceCursor, load
from workers.engine.step_trace import StepTrace


def _trace(worker: str, role: str, trace: StepTrace) -> dict[str, Any]:
    return {"worker_id": worker, "role": role, **trace.snapshot()}


def test_each_run_counts_only_the_steps_since_the_previous_look() -> None:
    prefill, decode = StepTrace(), StepTrace()
    prefill.record(1.0, 0.5, (256, 32896, 0, 0))  # before the run: the cluster's warm-up
    cursor = TraceCursor()
    cursor.advance([_trace("prefill-0", "prefill", prefill), _trace("decode-0", "decode", decode)])

    prefill.record(2.0, 0.75, (256, 98432, 0, 0))
    prefill.record(3.0, 1.0, (256, 163968, 0, 0))
    for i in range(4):
        decode.record(10.0 + i, 0.25, (0, 0, 2 + 2 * i, 4000))  # 2, 4, 6, 8 rows
    traces = [_trace("prefill-0", "prefill", prefill), _trace("decode-0", "decode", decode)]
    metrics = load(cursor.advance(traces), wall_s=2.0)
    assert set(metrics) == set(LOAD_KEYS)
    assert metrics["busy_prefill"] == pytest.approx(0.875)  # 1.75 s of 2, the 0.5 s left out
    assert metrics["busy_decode"] == pytest.approx(0.5)
    assert metrics["busy_mixed"] is None  # no such worker
    assert metrics["decode_rows_per_step"] == pytest.approx(5.0)

    # The next run: nothing stepped, so the workers were idle, not absent.
    idle = load(cursor.advance(traces), wall_s=1.0)
    assert idle["busy_prefill"] == idle["busy_decode"] == 0.0
    assert idle["decode_rows_per_step"] is None


def test_busy_is_the_mean_over_a_roles_workers_and_at_most_one() -> None:
    a, b = StepTrace(), StepTrace()
    a.record(0.0, 3.0, (0, 0, 4, 100))  # longer than the run's wall time: one step straddles it
    b.record(0.0, 0.5, (128, 8256, 2, 50))  # a mixed step: a chunk and two decode rows
    traces = [_trace("mixed-0", "mixed", a), _trace("mixed-1", "mixed", b)]
    metrics = load(TraceCursor().advance(traces), wall_s=2.0)
    assert metrics["busy_mixed"] == pytest.approx((1.0 + 0.25) / 2)
    assert metrics["decode_rows_per_step"] == pytest.approx(3.0)


def test_a_lost_workers_trace_is_left_out() -> None:
    trace = StepTrace()
    trace.record(0.0, 1.0, (0, 0, 1, 10))
    lost = {"worker_id": "decode-1", "role": "decode", "error": "ActorDiedError()"}
    metrics = load(TraceCursor().advance([_trace("decode-0", "decode", trace), lost]), 4.0)
    assert metrics["busy_decode"] == pytest.approx(0.25)


def test_a_run_without_wall_time_is_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        load([], wall_s=0.0)
