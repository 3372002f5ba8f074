"""Speculative decoding in the simulator: the acceptance profile and its draws, profiles read
from our engine's counters, the price of a verify step (and of the MTP module's passes) in
both cost models, and its effect on a decode-bound run."""

from __future__ import annotations

import itertools
import json
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest

from orchestrator.sim.cost import StepShape, create_cost_model
from orchestrator.sim.instances import EngineLimits
from orchestrator.sim.metrics import summarize
from orchestrator.sim.options import ServingOptions
from orchestrator.sim.simulator import Layout, Simulator, simulate
from orchestrator.sim.spec_profile import acceptance_from_counters, load_profile
from orchestrator.sim.speculative import SpecDecoding
from orchestrator.sim.workload import LengthDist, Workload
from tests.sim.toy import affine


@pytest.mark.parametrize("acceptance", [(0.87,), (0.9, 0.7), (0.8, 0.6, 0.4), (1.0, 0.0)])
def test_mean_kept_drafts_match_the_profiles_expectation(acceptance: tuple[float, ...]) -> None:
    spec = SpecDecoding(acceptance)
    kept = np.concatenate([spec.draws(seed=3, request_id=i, count=5000) for i in range(8)])
    assert kept.min() >= 0 and kept.max() <= spec.k
    assert kept.mean() == pytest.approx(spec.expected_kept(), abs=0.02)
    # Position i is kept only after position i - 1: P(kept >= i + 1) = prod(acceptance[:i+1]).
    for i, chain in enumerate(np.cumprod(acceptance)):
        assert np.mean(kept >= i + 1) == pytest.approx(chain, abs=0.02)


def test_draws_are_fixed_by_the_seed_and_the_request() -> None:
    spec = SpecDecoding((0.85, 0.6))
    assert np.array_equal(spec.draws(1, 7, 100), spec.draws(1, 7, 100))
    assert not np.array_equal(spec.draws(1, 7, 100), spec.draws(1, 8, 100))
    assert not np.array_equal(spec.draws(1, 7, 100), spec.draws(2, 7, 100))


@pytest.mark.parametrize(
    ("acceptance", "method"), [((), "mtp"), ((1.2,), "mtp"), ((-0.1,), "mtp"),
                               ((float("nan"),), "mtp"), ((0.5,) * 17, "mtp"), ((0.5,), "eagle")],
)  # fmt: skip
def test_bad_profiles_are_refused(acceptance: tuple[float, ...], method: str) -> None:
    with pytest.raises(ValueError):
        SpecDecoding(acceptance, method)  # type: ignore[arg-type]


def test_acceptance_from_the_engines_counters_is_conditional_per_position() -> None:
    # 1000 verifications of 3 drafts: 800 kept the first, 400 the first two, 100 all three.
    assert acceptance_from_counters(3000, [800, 400, 100], 3) == pytest.approx((0.8, 0.5, 0.25))
    assert acceptance_from_counters(1000, [700], 1) == pytest.approx((0.7,))
    with pytest.raises(ValueError, match="no drafts"):
        acceptance_from_counters(0, [], 1)


def test_profiles_load_from_a_metrics_scrape_and_from_json(tmp_path: Path) -> None:
    scrape = tmp_path / "metrics.txt"
    lines = []
    for worker in ("decode-0", "decode-1"):  # two workers' scrapes, concatenated
        labels = f'role="decode",model="{worker}"'
        lines += [
            "# TYPE pdserve_spec_decode_num_draft_tokens counter",
            f"pdserve_spec_decode_num_draft_tokens_total{{{labels}}} 1000.0",
            "# TYPE pdserve_spec_decode_num_accepted_tokens_per_pos counter",
            f'pdserve_spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="0"}} 450.0',
            f'pdserve_spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="1"}} 270.0',
            f'pdserve_spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="2"}} 0.0',
        ]
    scrape.write_text("\n".join(lines) + "\n")
    assert load_profile(scrape, 2) == pytest.approx((0.9, 0.6))
    assert load_profile(scrape, 1) == pytest.approx((0.45,))  # one draft a step: 1000 steps
    with pytest.raises(ValueError, match="--spec-k"):
        load_profile(scrape)
    counters = tmp_path / "counters.json"
    counters.write_text(
        json.dumps(
            {"speculative": {"num_speculative_tokens": 2, "num_draft_tokens": 200,
                             "num_accepted_tokens_per_pos": [90, 45]}}
        )
    )  # fmt: skip
    assert load_profile(counters) == pytest.approx((0.9, 0.5))
    assert load_profile(counters, 1) == pytest.approx((0.9,))
    given = tmp_path / "given.json"
    given.write_text(json.dumps({"acceptance": [0.87, 0.7]}))
    assert load_profile(given) == (0.87, 0.7)
    with pytest.raises(ValueError, match="not 3"):
        load_profile(given, 3)
    with pytest.raises(ValueError, match="no such"):
        load_profile(tmp_path / "missing.json")


def _verify_shape(seqs: int, context: int, k: int, mtp: bool) -> StepShape:
    drafts = seqs * k
    attention = seqs * (k * (context + 1) + k * (k + 1) // 2)
    passes = k if mtp else 0
    return StepShape(0, 0, seqs, seqs * (context + 1), drafts, attention,
                     seqs * (k + 1) if mtp else 0, passes)  # fmt: skip


@pytest.mark.parametrize("cost_spec", ["roofline:deepseek-r1:h200:8x400g", "toy"])
def test_a_verify_step_costs_more_and_every_field_is_monotone(cost_spec: str) -> None:
    cost = affine() if cost_spec == "toy" else create_cost_model(cost_spec)
    tp = 8 if cost_spec != "toy" else 1
    plain = _verify_shape(32, 4000, 0, mtp=False)
    verify = _verify_shape(32, 4000, 1, mtp=False)
    with_mtp = _verify_shape(32, 4000, 1, mtp=True)
    seconds = [cost.step_seconds(s, tp) for s in (plain, verify, with_mtp)]
    assert seconds[0] < seconds[1] < seconds[2]
    # Non-decreasing in every field (the contract the simulator's monotonicity rests on).
    base = StepShape(256, 256 * 300, 16, 16 * 3000, 16, 16 * 3001, 40, 1)
    for field, more in itertools.product(fields(StepShape), (1, 64, 4096)):
        larger = replace(base, **{field.name: getattr(base, field.name) + more})
        assert cost.step_seconds(larger, tp) >= cost.step_seconds(base, tp), field.name


def test_mtp_on_a_model_without_an_mtp_module_is_refused_before_the_run() -> None:
    llama = create_cost_model("roofline:llama-3-70b:h100")
    options = ServingOptions(SpecDecoding((0.8,), "mtp"))
    with pytest.raises(ValueError, match="no MTP module"):
        Simulator(llama, Layout(num_mixed=1, tp_mixed=4), options=options)
    ngram = ServingOptions(SpecDecoding((0.8,), "ngram"))
    Simulator(llama, Layout(num_mixed=1, tp_mixed=4), options=ngram)  # drafts cost no pass


def _decode_bound() -> Workload:
    return Workload(2.0, 60, LengthDist.parse("fixed:256"), LengthDist.parse("uniform:200-400"))


@pytest.mark.parametrize(
    "layout",
    [
        Layout(num_prefill=1, num_decode=2, tp_prefill=8, tp_decode=8),
        Layout(num_mixed=2, tp_mixed=8),
    ],
    ids=lambda x: x.label,
)
def test_drafts_raise_tok_s_per_request_on_a_decode_bound_run(layout: Layout) -> None:
    cost = create_cost_model("roofline:deepseek-r1:h200:8x400g")
    workload = _decode_bound()
    plain = simulate(cost, layout, workload)
    options = ServingOptions(SpecDecoding((0.87,)))
    drafted = simulate(cost, layout, workload, options=options)
    again = simulate(cost, layout, workload, options=options)
    assert [r.finish_time for r in drafted.records] == [r.finish_time for r in again.records]
    # Every request still emits exactly its tokens; a step that emits two gives a 0 gap.
    for record in drafted.records:
        assert len(record.itl_gaps) == record.num_output_tokens - 1
        assert np.count_nonzero(record.itl_gaps == 0) > 0
    fast, slow = summarize(drafted), summarize(plain)
    # Not the 1.87x of the tokens per step: each step costs more (rows, experts, the module).
    assert 1.2 * slow.tokens_per_s_per_request < fast.tokens_per_s_per_request
    assert fast.tokens_per_s_per_request < 1.87 * slow.tokens_per_s_per_request


def test_a_profile_that_keeps_nothing_backs_off_and_costs_little() -> None:
    cost = affine()
    layout = Layout(num_prefill=1, num_decode=1)
    workload = _decode_bound()
    limits = EngineLimits(max_num_seqs=16)
    plain = summarize(simulate(cost, layout, workload, limits))
    never = summarize(
        simulate(cost, layout, workload, limits, ServingOptions(SpecDecoding((0.0,), "ngram")))
    )
    always = summarize(
        simulate(cost, layout, workload, limits, ServingOptions(SpecDecoding((1.0,), "ngram")))
    )
    # Drafts never kept: the sequences back off (1, 2, 4 ... 16 steps) and verify few of them.
    assert never.tokens_per_s_per_request > 0.85 * plain.tokens_per_s_per_request
    assert always.tokens_per_s_per_request > 1.5 * plain.tokens_per_s_per_request
