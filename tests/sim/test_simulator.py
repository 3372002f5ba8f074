"""Invariants of the simulator on toy cost models: conservation, causality, monotonicity; the
layouts it refuses, its SLOs, and the percentile definition it shares with the load generator."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest

from orchestrator.loadgen.stats import distribution
from orchestrator.sim.cost import create_cost_model
from orchestrator.sim.instances import EngineLimits
from orchestrator.sim.metrics import SLO, summarize
from orchestrator.sim.simulator import (
    Layout,
    RequestRecord,
    SimResult,
    Simulator,
    UnservableError,
    UnsupportedLayoutError,
    simulate,
)
from orchestrator.sim.workload import LengthDist, RequestSpec, Workload
from tests.sim.test_cli import LLAMA_H200
from tests.sim.toy import affine

LAYOUTS = [
    Layout(num_prefill=1, num_decode=3),
    Layout(num_prefill=2, num_decode=1, tp_prefill=2),
    Layout(num_mixed=2, tp_mixed=2),
]


def _workload(rate: float, seed: int = 0, num: int = 150) -> Workload:
    return Workload(
        rate, num, LengthDist.parse("chat:200:1-2000"), LengthDist.parse("chat:40:1-300"), seed=seed
    )


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.label)
def test_every_arrival_finishes_once_and_times_are_causal(layout: Layout) -> None:
    workload = _workload(rate=20.0)
    limits = EngineLimits(max_num_seqs=8, max_num_batched_tokens=256)
    result = simulate(affine(capacity=4096), layout, workload, limits)
    specs = workload.requests()
    assert [r.request_id for r in result.records] == [s.request_id for s in specs]
    for record, spec in zip(result.records, specs, strict=True):
        assert record.num_output_tokens == spec.num_output_tokens
        assert 0 <= record.arrival_time <= record.prefill_start_time <= record.kv_ready_time
        assert record.kv_ready_time <= record.first_token_time <= record.finish_time
        assert 0 <= record.ttft <= record.e2e
        assert record.tpot >= 0
        # Its tokens come out of back-to-back steps: the longest gap is at least the mean.
        assert record.max_itl >= record.tpot * (1 - 1e-9)
        if record.num_output_tokens < 2:
            assert record.max_itl == 0
    assert all(duration > 0 for duration, _ in result.itl_steps)


def test_one_token_prompts_and_answers_are_served() -> None:
    workload = Workload(5.0, 40, LengthDist.parse("fixed:1"), LengthDist.parse("fixed:1"))
    for layout in LAYOUTS:
        result = simulate(affine(), layout, workload)
        assert len(result.records) == 40
        assert all(r.tpot == 0 and r.ttft > 0 for r in result.records)


def test_a_request_larger_than_the_kv_pool_is_refused_up_front() -> None:
    workload = Workload(1.0, 3, LengthDist.parse("fixed:900"), LengthDist.parse("fixed:200"))
    with pytest.raises(UnservableError):
        simulate(affine(capacity=1000), LAYOUTS[0], workload)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.label)
def test_latency_does_not_fall_as_load_rises(layout: Layout) -> None:
    # Averages over seeds: one seed's queueing can dip between two close rates by chance.
    means = []
    for rate in (2.0, 8.0, 32.0, 128.0):
        runs = [summarize(simulate(affine(), layout, _workload(rate, seed))) for seed in range(3)]
        ttft = np.mean([s.ttft_mean for s in runs])
        queue = np.mean([s.queue_mean for s in runs])
        tpot = np.mean([s.tpot_mean for s in runs])
        means.append((ttft, queue, tpot))
    for low, high in itertools.pairwise(means):
        assert high[0] >= low[0] * 0.999
        assert high[1] >= low[1] - 1e-9
        assert high[2] >= low[2] * 0.999


def test_mixed_steps_stall_decodes_that_disaggregation_does_not() -> None:
    # Prefill chunks cost far more than decode steps: in mixed mode they land in decode steps.
    cost = affine(prefill=(0.002, 1e-4, 0.0), decode=(0.005, 1e-4, 0.0))
    workload = Workload(4.0, 200, LengthDist.parse("fixed:2000"), LengthDist.parse("fixed:100"))
    limits = EngineLimits(max_num_batched_tokens=512)
    mixed = summarize(simulate(cost, Layout(num_mixed=2), workload, limits), warmup=0.1)
    split = summarize(
        simulate(cost, Layout(num_prefill=1, num_decode=1), workload, limits), warmup=0.1
    )
    assert mixed.itl_p99 > 3 * split.itl_p99
    mixed_run = simulate(cost, Layout(num_mixed=2), workload, limits)
    stalls = [r.max_itl for r in mixed_run.records]
    assert max(stalls) > 0.05  # a 512-token chunk costs ~ 0.05 s more than a decode step
    assert split.tokens_per_s_per_request > mixed.tokens_per_s_per_request


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.label)
def test_a_request_overhead_shifts_every_request_and_changes_no_step(layout: Layout) -> None:
    # Every arrival reaches the router the same fixed time later, so the whole run is the
    # same run shifted: TTFT and E2E grow by exactly the overhead, steps are unchanged.
    workload = _workload(rate=10.0, num=60)
    limits = EngineLimits(max_num_seqs=8, max_num_batched_tokens=256)
    base = simulate(affine(capacity=4096), layout, workload, limits)
    delayed = simulate(affine(capacity=4096, overhead=(0.25, 0.125)), layout, workload, limits)
    overhead = 0.125 if layout.is_mixed else 0.25
    for a, b in zip(base.records, delayed.records, strict=True):
        assert b.arrival_time == a.arrival_time
        assert b.ttft == pytest.approx(a.ttft + overhead)
        assert b.e2e == pytest.approx(a.e2e + overhead)
        assert b.queue_time == pytest.approx(a.queue_time + overhead)
    assert [d for d, _ in delayed.itl_steps] == pytest.approx([d for d, _ in base.itl_steps])


def test_a_negative_request_overhead_is_refused() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        affine(overhead=(-0.1, 0.0))


def test_instances_sharing_cores_slow_each_other_only_when_both_step() -> None:
    # A model measured alone and with the other process stepping (3x slower): a lone request
    # sees alone prices; requests that overlap see slower steps, never faster ones.
    alone, contended = affine(), affine(prefill=(0.006, 3e-5, 0.0), decode=(0.015, 6e-4, 3e-7))
    shared = dataclasses.replace(
        contended,
        alone_coefficients=(alone.prefill_coefficients, alone.decode_coefficients),
        contention_processes=2,
    )
    layout, limits = Layout(num_prefill=1, num_decode=1), EngineLimits(8, 256)
    lone = Workload(1.0, 1, LengthDist.parse("fixed:600"), LengthDist.parse("fixed:20"))
    assert simulate(shared, layout, lone, limits).records[0].e2e == pytest.approx(
        simulate(alone, layout, lone, limits).records[0].e2e
    )
    busy = _workload(rate=20.0, num=80)
    by_alone = simulate(alone, layout, busy, limits).records
    by_shared = simulate(shared, layout, busy, limits).records
    by_contended = simulate(contended, layout, busy, limits).records
    assert sum(r.e2e for r in by_alone) < sum(r.e2e for r in by_shared)
    assert sum(r.e2e for r in by_shared) <= sum(r.e2e for r in by_contended)


def test_itl_percentiles_pool_only_the_measured_requests_gaps() -> None:
    # Fill-up and drain: the first and last requests decode in long steps, the middle ones in
    # short ones. Cutting the first and last request cuts their steps from ITL too.
    def record(i: int, gap: float) -> RequestRecord:
        gaps = np.full(9, gap)
        return RequestRecord(i, float(i), i, i, i + 0.1, i + 0.1 + gaps.sum(), 8, 10, gap, gaps)

    records = tuple(record(i, 1.0 if i in (0, 9) else 0.01) for i in range(10))
    steps = tuple((r.max_itl, 1) for r in records for _ in range(9))
    result = SimResult(Layout(num_mixed=1), records, steps, (1.0,))
    assert summarize(result, warmup=0.0).itl_p99 == 1.0
    cut = summarize(result, warmup=0.1)
    assert (cut.num_requests, cut.itl_p50, cut.itl_p99) == (8, 0.01, 0.01)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_itl_of_a_run_is_its_records_gaps(layout: Layout) -> None:
    result = simulate(affine(), layout, _workload(rate=8.0, num=60), EngineLimits(8, 256))
    # Without a cut, the records' gaps are the step log's gaps, each once.
    steps = sorted(d for d, n in result.itl_steps for _ in range(n))
    assert sorted(np.concatenate([r.itl_gaps for r in result.records])) == steps
    kept = sorted(result.records, key=lambda r: r.arrival_time)[15:45]
    gaps = np.sort(np.concatenate([r.itl_gaps for r in kept]))
    summary = summarize(result, warmup=0.25)
    assert summary.itl_p99 == np.percentile(gaps, 99)  # interpolated, as the load generator


@pytest.mark.parametrize(("page_size", "ttft"), [(16, 3.5), (1, 2.5)])
def test_prompt_chunks_end_on_page_boundaries_as_the_engine_schedules_them(
    page_size: int, ttft: float
) -> None:
    # Every step costs 1 s. A decodes from t=1; B's 500-token prompt arrives at t=0.5 and
    # shares each step's 256 tokens with A's decode: on 16-token pages its chunks are 240,
    # 240 and 20 (first token at t=4), not 255 and 245 (t=3) as they would be unaligned.
    cost = affine(prefill=(1.0, 0.0, 0.0), decode=(1.0, 0.0, 0.0))
    limits = EngineLimits(max_num_seqs=8, max_num_batched_tokens=256, page_size=page_size)
    requests = [RequestSpec(0, 0.0, 16, 50), RequestSpec(1, 0.5, 500, 2)]
    result = Simulator(cost, Layout(num_mixed=1), limits).run(requests)
    assert result.records[1].ttft == pytest.approx(ttft)


@pytest.mark.parametrize(
    "layout",
    [Layout(num_prefill=1, num_decode=1), Layout(num_mixed=1)],
    ids=lambda layout: layout.label,
)
def test_paced_decode_steps_start_an_interval_apart_and_first_tokens_are_not_delayed(
    layout: Layout,
) -> None:
    # Every step costs 1 s; decode-only steps start 3 s apart. A alone gets a token per 3 s
    # instead of per 1 s. B arrives at 4.5 s, mid-interval: its prompt (mixed) or its arrived
    # KV (decode) is prompt work, which starts at once (its TTFT is A's), and that step
    # decodes A too, 1.5 s after A's token before.
    cost = affine(prefill=(1.0, 0.0, 0.0), decode=(1.0, 0.0, 0.0))
    requests = [RequestSpec(0, 0.0, 16, 5), RequestSpec(1, 4.5, 16, 2)]
    plain = Simulator(cost, layout, EngineLimits(8, 256)).run(requests[:1]).records[0]
    paced = EngineLimits(8, 256, min_step_interval_s=3.0)
    alone = Simulator(cost, layout, paced).run(requests[:1]).records[0]
    a, b = sorted(Simulator(cost, layout, paced).run(requests).records, key=lambda r: r.request_id)
    assert list(plain.itl_gaps) == pytest.approx([1.0] * 4)
    assert list(alone.itl_gaps) == pytest.approx([3.0] * 4)
    assert alone.ttft == a.ttft == pytest.approx(plain.ttft)
    assert b.ttft == pytest.approx(a.ttft)
    assert list(a.itl_gaps) == pytest.approx([3.0, 1.5, 3.0, 3.0])


def test_a_negative_step_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="min_step_interval_s must be >= 0"):
        EngineLimits(min_step_interval_s=-0.01)


def test_a_token_budget_under_one_page_is_refused() -> None:
    with pytest.raises(ValueError, match="at least page_size"):
        EngineLimits(max_num_batched_tokens=8, page_size=16)


def test_a_simulator_of_an_unsupported_layout_is_a_typed_error() -> None:
    cost = create_cost_model(LLAMA_H200)
    with pytest.raises(UnsupportedLayoutError, match="TP 1"):
        Simulator(cost, Layout(num_prefill=1, num_decode=1, tp_prefill=2, tp_decode=1))
    Simulator(cost, Layout(num_prefill=1, num_decode=1, tp_prefill=2, tp_decode=2))


@pytest.mark.parametrize(
    "bounds",
    [(2.0, 0.05, 0.0), (2.0, 0.05, math.nan), (math.nan, 0.05, None), (2.0, math.nan, None),
     (2.0, math.inf, None), (2.0, 0.05, -1.0)],
)  # fmt: skip
def test_slos_must_be_positive_finite_seconds(bounds: tuple[float, float, float | None]) -> None:
    with pytest.raises(ValueError, match="SLOs must be positive"):
        SLO(*bounds)


def test_simulated_percentiles_are_the_load_generators() -> None:
    # Gaps 1..10 ms: nearest rank would give p50 5 ms and p99 10 ms, interpolation 5.5 and 9.91.
    gaps = np.arange(1, 11) * 1e-3
    record = RequestRecord(0, 0.0, 0.0, 0.0, 0.1, 0.1 + gaps.sum(), 8, 11, gaps.max(), gaps)
    ttfts = [0.1, 0.4, 0.2, 0.9]
    records = (
        record,
        *(
            RequestRecord(i, 0.0, 0.0, 0.0, ttft, ttft + 0.01, 8, 1)
            for i, ttft in enumerate(ttfts[1:], 1)
        ),
    )
    summary = summarize(SimResult(Layout(num_mixed=1), records, (), (1.0,)))
    measured = distribution(list(gaps))
    assert (summary.itl_p50, summary.itl_p99) == (measured["p50"], measured["p99"])
    assert summary.itl_p99 == pytest.approx(9.91e-3)
    assert summary.ttft_p99 == distribution(ttfts)["p99"]


def test_the_slowest_tenth_of_requests_is_reported_beside_the_mean_speed() -> None:
    # Eight requests decode at 100 tok/s, two stalled ones at 20: the mean (84) hides them,
    # the 10th percentile over requests does not.
    def record(i: int, tpot: float) -> RequestRecord:
        return RequestRecord(i, float(i), i, i, i + 0.1, i + 0.1 + 10 * tpot, 8, 11)

    records = tuple(record(i, 0.05 if i in (3, 7) else 0.01) for i in range(10))
    summary = summarize(SimResult(Layout(num_mixed=1), records, (), (1.0,)))
    assert summary.tokens_per_s_per_request == pytest.approx(84.0)
    assert summary.tokens_per_s_per_request_p10 == pytest.approx(20.0)
    assert "(p10   20.0)" in summary.row()
