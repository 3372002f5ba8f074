"""Expert parallelism across decode instances in the roofline model (`Layout.ep_decode`,
`CostModel.spread_experts`): a domain of instances keeps one copy of the routed experts,
reads its share of what the domain's tokens select and pays dispatch / combine over the NICs;
the planner tries such layouts when asked and never emits one."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.cli.main import main
from orchestrator.sim.commands import parse_layout
from orchestrator.sim.cost import StepShape, create_cost_model
from orchestrator.sim.metrics import SLO
from orchestrator.sim.planner import PlanSpec, layouts
from orchestrator.sim.roofline import RooflineCostModel
from orchestrator.sim.simulator import Layout, Simulator, UnsupportedLayoutError
from orchestrator.sim.workload import LengthDist, Workload
from tests.sim.toy import affine

R1 = "roofline:deepseek-r1:h200:8x400g"


def _r1() -> RooflineCostModel:
    cost = create_cost_model(R1)
    assert isinstance(cost, RooflineCostModel)
    return cost


# DeepEP's low-latency kernels on H800 with one 400 Gb/s CX7 NIC per GPU, DeepSeek-V3/R1's
# decode setting (128 tokens per GPU, hidden 7168, top-8 experts, FP8 dispatch, BF16
# combine), as its README publishes them: EP size -> dispatch + combine microseconds.
DEEPEP_LOW_LATENCY_US = {16: 118 + 195, 32: 155 + 273, 64: 173 + 314, 128: 192 + 369}


@pytest.mark.parametrize("ep", sorted(DEEPEP_LOW_LATENCY_US))
def test_the_all_to_all_price_is_deepeps_published_latency_within_15_percent(ep: int) -> None:
    # Fixed before any comparison with a serving result: the NIC preset (50 GB/s, 5 us) and
    # the a-priori NIC efficiency (0.8) alone set the price.
    nodes = ep // 8
    cost = _r1().spread_experts(nodes)
    one_layer = cost._alltoall_seconds(tokens=8 * 128, tp=8, moe_layers=1)
    published = DEEPEP_LOW_LATENCY_US[ep] * 1e-6
    assert abs(one_layer - published) <= 0.15 * published


def test_a_domain_reads_a_share_of_the_experts_and_pays_the_all_to_all() -> None:
    alone, spread = _r1(), _r1().spread_experts(3)
    assert alone.spread_experts(1) == alone
    decode = StepShape(num_decode_seqs=16, num_decode_kv_tokens=16 * 6000)
    # Sixteen tokens touch ~40% of a layer's experts; the domain's 48 touch ~78%, a third of
    # them on each instance: fewer bytes, and a decode step is bound by them.
    assert spread.step_seconds(decode, 8) < 0.9 * alone.step_seconds(decode, 8)
    assert spread._alltoall_seconds(16, 8, 58) > 0 == alone._alltoall_seconds(16, 8, 58)
    # A prefill step is compute-bound: spreading the experts saves it nothing, the
    # all-to-all of its 2048 tokens costs it.
    prefill = StepShape(2048, 2048 * 2049 // 2)
    assert spread.step_seconds(prefill, 8) > alone.step_seconds(prefill, 8)
    # Each instance holds a third of the routed experts: room for more KV.
    assert spread.kv_capacity_tokens(8) > 2 * alone.kv_capacity_tokens(8)
    assert "experts over 3 instances" in spread.name


def test_experts_spread_only_where_there_are_experts_and_a_roofline_to_price_them() -> None:
    with pytest.raises(ValueError, match="no routed experts"):
        create_cost_model("roofline:llama-3-70b:h100").spread_experts(2)
    calibrated = affine()
    assert calibrated.spread_experts(1) is calibrated
    with pytest.raises(ValueError, match="cannot price experts spread"):
        calibrated.spread_experts(2)


def test_the_layout_names_its_domain_and_refuses_one_it_cannot_form() -> None:
    layout = parse_layout("1x8:3x8:ep3")
    assert layout == Layout(num_prefill=1, num_decode=3, tp_prefill=8, tp_decode=8, ep_decode=3)
    assert layout.label == "1P(tp8):3D(tp8,ep24)" and layout.num_gpus == 32
    assert parse_layout("1x8:3x8").ep_decode == 1
    for bad in ("1x8:3x8:ep2", "1x8:3x8:epx", "4x8:ep4", "1x8:3x8:ep0"):
        with pytest.raises(ValueError):
            parse_layout(bad)


def test_decoders_of_a_domain_may_run_at_a_tp_too_small_for_every_expert() -> None:
    # Data-parallel decoders: 24 ranks of one GPU each, the experts spread over all 24.
    cost = _r1()
    ranks = parse_layout("5x8:24x1:ep24")
    assert ranks.label == "5P(tp8):24D(tp1,ep24)" and ranks.num_gpus == 64
    assert not cost.supports_tp(1) and cost.spread_experts(24).supports_tp(1)
    Simulator(cost, ranks)  # each rank holds its 24th of the experts
    with pytest.raises(UnsupportedLayoutError, match="TP 1"):
        Simulator(cost, parse_layout("5x8:24x1"))  # each rank holding every expert
    with pytest.raises(UnsupportedLayoutError, match="TP 1"):
        Simulator(cost, parse_layout("5x1:24x1:ep24"))  # prefill ranks hold every expert


def _plan_spec(expert_parallel: bool, budget: int = 24) -> PlanSpec:
    workload = Workload(1.0, 40, LengthDist.parse("fixed:2000"), LengthDist.parse("fixed:200"))
    return PlanSpec(
        workload, SLO(2.0, 0.011), budget, tp_choices=(8,), expert_parallel=expert_parallel
    )


def test_the_planner_tries_each_decode_group_as_one_domain_only_when_asked() -> None:
    plain = list(layouts(_r1(), _plan_spec(False)))
    wide = list(layouts(_r1(), _plan_spec(True)))
    assert all(layout.ep_decode == 1 for layout in plain)
    # Each layout of several decoders once more, its decoders one domain; nothing else.
    domains = [layout for layout in wide if layout.ep_decode > 1]
    assert domains == [Layout(num_prefill=1, num_decode=2, tp_prefill=8, tp_decode=8, ep_decode=2)]
    assert [layout for layout in wide if layout.ep_decode == 1] == plain
    for dense in (create_cost_model("roofline:llama-3-70b:h100"), affine()):
        with pytest.raises(ValueError, match="expert parallelism"):
            list(layouts(dense, _plan_spec(True)))


def test_a_plan_with_expert_parallel_layouts_emits_and_applies_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["plan", "--cost", R1, "--gpus", "24", "--tp", "8", "--expert-parallel"]
    for extra in (["--emit-config", str(tmp_path / "c.yaml")], ["--apply", "127.0.0.1:1"]):
        assert main([*base, *extra]) == 2
        assert "--expert-parallel plans layouts pdserve's engine does not run" in (
            capsys.readouterr().err
        )
    assert not (tmp_path / "c.yaml").exists()
