"""The planner on small cases whose optimum is clear by hand, and its emitted configs: the cluster
config and the Helm values carry the KV pool, model path and provider the plan assumed, as the
chart renders them."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from orchestrator.cli.main import main
from orchestrator.config.cluster import ClusterConfig, ConfigError
from orchestrator.loadgen.validate import limits_of
from orchestrator.sim import planner
from orchestrator.sim.cost import create_cost_model
from orchestrator.sim.emit import (
    PAGE_SIZE,
    check_options,
    checked_cluster_config,
    cluster_config,
    helm_values,
)
from orchestrator.sim.instances import EngineLimits
from orchestrator.sim.metrics import SLO
from orchestrator.sim.planner import PlanSpec, evaluate, format_table, layouts, plan
from orchestrator.sim.shared_cores import SharedCores
from orchestrator.sim.simulator import Layout
from orchestrator.sim.workload import LengthDist, Workload
from tests.ops.helm_chart import CHART, NAMESPACE, RELEASE, cluster_yaml
from tests.sim.test_cli import LLAMA_H200, PLAN
from tests.sim.toy import affine

LIMITS = EngineLimits(max_num_seqs=4, max_num_batched_tokens=2048)


def _spec(prompt: str, output: str, slo: SLO, budget: int = 4) -> PlanSpec:
    workload = Workload(2.0, 80, LengthDist.parse(prompt), LengthDist.parse(output), seed=3)
    return PlanSpec(
        workload,
        slo,
        budget,
        tp_choices=(1,),
        include_mixed=False,
        limits=LIMITS,
        bisect_steps=5,
        min_duration_s=4.0,
    )


def _count_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The planner's simulations from now on, as their numbers of requests."""
    sizes: list[int] = []
    simulate = planner.simulate

    def counted(*args: Any) -> Any:
        sizes.append(args[2].num_requests)
        return simulate(*args)

    monkeypatch.setattr(planner, "simulate", counted)
    return sizes


def test_a_rate_is_judged_once_the_cluster_has_filled_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # Answers of 1024 tokens keep a request ~20 s in the cluster; 2 s of arrivals (a tenth of
    # them left out) measure requests that arrived into a nearly empty one.
    cost = create_cost_model("roofline:llama-3-70b:h100")
    workload = Workload(1.0, 40, LengthDist.parse("fixed:1000"), LengthDist.parse("fixed:1024"))
    spec = PlanSpec(workload, SLO(2.0, 0.05), 8, tp_choices=(4,), min_duration_s=2.0)
    mixed = Layout(num_mixed=2, tp_mixed=4)
    sizes = _count_runs(monkeypatch)
    settled = evaluate(cost, mixed, spec, 20.0)
    assert settled is not None and settled.slo_attainment < spec.attainment
    assert len(sizes) > 1 and sizes == sorted(sizes)  # run again, longer, until it filled up
    # A run that misses the SLOs stands without a longer one: it could only do worse.
    sizes.clear()
    missed = evaluate(cost, mixed, spec, 200.0)
    assert missed is not None and missed.slo_attainment < spec.attainment
    assert len(sizes) == 1
    monkeypatch.setattr(planner, "SETTLE_RUNS", 1)  # the short run alone flatters the layout
    short = evaluate(cost, mixed, spec, 20.0)
    assert short is not None and short.slo_attainment >= spec.attainment


def test_a_rate_whose_queue_grows_is_run_again_until_it_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One decoder of 64 sequences, 512-token answers: ~6 req/s at most, so at 8 the queue
    # grows. 120 s of arrivals, 30% left out at each end, outlast a request's stay (settled),
    # and its TTFTs stay under a lax 30 s SLO: the run alone would pass.
    cost = create_cost_model("roofline:llama-3-70b:h100")
    workload = Workload(8.0, 960, LengthDist.parse("fixed:1000"), LengthDist.parse("fixed:512"))
    spec = PlanSpec(workload, SLO(30.0, 0.05), 8, tp_choices=(4,), min_duration_s=120.0, warmup=0.3)
    split = Layout(num_prefill=1, num_decode=1, tp_prefill=4, tp_decode=4)
    sizes = _count_runs(monkeypatch)
    judged = evaluate(cost, split, spec, 8.0)
    assert judged is not None and judged.slo_attainment < spec.attainment
    assert len(sizes) > 1 and sizes == sorted(sizes)
    monkeypatch.setattr(planner, "SETTLE_RUNS", 1)  # the first run: settled, and it passes
    first = evaluate(cost, split, spec, 8.0)
    assert first is not None and first.slo_attainment >= spec.attainment


def test_layouts_stay_within_the_budget_and_supported_tp() -> None:
    spec = PlanSpec(
        Workload(1.0, 10, LengthDist.parse("fixed:8"), LengthDist.parse("fixed:8")),
        SLO(1.0, 1.0),
        gpu_budget=8,
        tp_choices=(1, 2, 4, 16),
    )
    found = list(layouts(affine(), spec))
    assert found and all(layout.num_gpus <= 8 for layout in found)
    assert {layout.tp_decode for layout in found if not layout.is_mixed} == {1, 2, 4}
    assert Layout(num_prefill=1, num_decode=7) in found and Layout(num_mixed=8) in found


def test_decode_bound_workload_gets_more_decode_than_prefill() -> None:
    # Prefill of 16 tokens is ~2 ms; decode runs at most 4 sequences per 8.8 ms step for 64
    # tokens: one decode instance serves ~7 req/s, one prefill instance hundreds.
    cost = affine(prefill=(0.002, 1e-5, 0.0), decode=(0.008, 2e-4, 0.0))
    candidates = plan(cost, _spec("fixed:16", "fixed:64", SLO(ttft_s=1.0, tpot_s=0.05)))
    best = candidates[0].layout
    assert (best.num_prefill, best.num_decode) == (1, 3)
    assert candidates[0].goodput_per_gpu > candidates[-1].goodput_per_gpu > 0


def test_prefill_bound_workload_gets_more_prefill_than_decode() -> None:
    # A 2048-token prompt costs ~0.2 s of prefill; its 4 output tokens almost nothing.
    cost = affine(prefill=(0.005, 1e-4, 0.0), decode=(0.002, 1e-5, 0.0))
    candidates = plan(cost, _spec("fixed:2048", "fixed:4", SLO(ttft_s=2.0, tpot_s=0.05)))
    best = candidates[0].layout
    assert (best.num_prefill, best.num_decode) == (3, 1)
    table = format_table(candidates, top=3)
    assert "3P(tp1):1D(tp1)" in table.splitlines()[1]


def test_emitted_config_loads_and_helm_values_match_the_chart(tmp_path: Path) -> None:
    layout = Layout(num_prefill=1, num_decode=3, tp_prefill=8, tp_decode=4)
    raw = cluster_config(layout, EngineLimits(), model_path=str(tmp_path / "model"))
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(raw))
    config = ClusterConfig.from_yaml(path)
    assert (config.group("prefill").replicas, config.group("prefill").tp) == (1, 8)
    assert (config.group("decode").replicas, config.group("decode").tp) == (3, 4)
    assert config.device == "cuda"  # a GPU per rank, TP groups included
    mixed = ClusterConfig.from_dict(cluster_config(Layout(num_mixed=2, tp_mixed=2), EngineLimits()))
    assert mixed.group("mixed").tp == 2
    single = Layout(num_prefill=2, num_decode=2)
    gpu = ClusterConfig.from_dict(cluster_config(single, EngineLimits()))
    assert gpu.device == "cuda" and gpu.group("decode").resources_per_rank.gpu == 1
    single_values = helm_values(single, EngineLimits())
    assert single_values is not None and single_values["clusterConfig"]["device"] == "cuda"
    chart = yaml.safe_load(Path("helm/pdserve/values.yaml").read_text())
    values = helm_values(layout, EngineLimits())
    assert values is not None and helm_values(Layout(num_mixed=1), EngineLimits()) is None
    for role, group in values["workerGroups"].items():
        assert set(group) <= set(chart["workerGroups"][role])
    assert (
        values["workerGroups"]["decode"] | {"replicas": 3, "tpPerPod": 4}
        == values["workerGroups"]["decode"]
    )
    assert set(values) <= set(chart)


def test_a_stall_bound_turns_the_choice_from_mixed_to_disaggregated() -> None:
    # Prefill chunks cost 10x a decode step: mixed wins on TPOT alone (it decodes on every
    # instance), but every chunk it mixes in stalls all decodes beyond a 30 ms gap.
    cost = affine(prefill=(0.002, 1e-4, 0.0), decode=(0.008, 1e-4, 0.0))
    workload = Workload(4.0, 80, LengthDist.parse("fixed:1024"), LengthDist.parse("fixed:64"))
    limits = EngineLimits(max_num_seqs=16, max_num_batched_tokens=512)

    def best(slo: SLO) -> Layout:
        spec = PlanSpec(
            workload, slo, 4, tp_choices=(1,), limits=limits, bisect_steps=4, min_duration_s=4.0
        )
        return plan(cost, spec)[0].layout

    assert best(SLO(ttft_s=2.0, tpot_s=0.05)).is_mixed
    assert not best(SLO(ttft_s=2.0, tpot_s=0.05, max_itl_s=0.03)).is_mixed


def test_layouts_stay_within_the_loaders_group_ratio() -> None:
    spec = PlanSpec(
        Workload(1.0, 10, LengthDist.parse("fixed:8"), LengthDist.parse("fixed:8")),
        SLO(1.0, 1.0),
        gpu_budget=20,
        tp_choices=(1,),
        include_mixed=False,
    )
    found = list(layouts(affine(), spec))
    assert Layout(num_prefill=1, num_decode=16) in found
    assert Layout(num_prefill=16, num_decode=1) in found
    for beyond in (Layout(num_prefill=1, num_decode=17), Layout(num_prefill=17, num_decode=1)):
        assert beyond not in found
    for layout in found:  # every candidate is a config the orchestrator loads
        ClusterConfig.from_dict(cluster_config(layout, LIMITS))


def test_an_emitted_config_the_loader_refuses_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="beyond 1:16"):
        checked_cluster_config(Layout(num_prefill=1, num_decode=17), LIMITS)
    with pytest.raises(ConfigError, match="multiple of page_size"):
        check_options(EngineLimits(64, 1000), model_path="/models/model", provider="efa")
    with pytest.raises(ConfigError, match="cannot register GPU memory"):
        check_options(EngineLimits(), model_path="/models/model", provider="tcp;ofi_rxm")
    check_options(EngineLimits(64, 1024), model_path="/models/model", provider="verbs;ofi_rxm")


# --- the emitted config and Helm values, as the chart deploys them ---------------------------


def _rendered_config(values: dict[str, Any]) -> ClusterConfig:
    """The cluster config the chart renders from ``values``, after its schema accepts them."""
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(values)
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    docs = [
        doc
        for path, text in manifests.items()
        if path.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]
    return ClusterConfig.from_dict(cluster_yaml(docs))


def test_the_emitted_config_and_helm_values_hold_the_kv_pool_the_plan_assumed() -> None:
    cost = create_cost_model(LLAMA_H200)
    layout = Layout(num_prefill=1, num_decode=1, tp_prefill=2, tp_decode=2)
    planned = cost.kv_capacity_tokens(2)  # 397,212 tokens per instance
    emitted = ClusterConfig.from_dict(checked_cluster_config(layout, EngineLimits(), cost))
    values = helm_values(layout, EngineLimits(), cost=cost)
    assert values is not None
    deployed = _rendered_config(values)
    for config in (emitted, deployed):
        for role in ("prefill", "decode"):
            held = limits_of(config, role, cost).kv_capacity_tokens
            # Whole pages of the planned pool, not the engine's 256 MiB default (1,632 tokens).
            assert held is not None and planned - PAGE_SIZE < held <= planned
    # A pool the limits give (a served config's) is the one emitted, whatever the cost model.
    fixed = EngineLimits(kv_capacity_tokens=4096)
    raw = checked_cluster_config(layout, fixed, cost)
    assert raw["groups"]["decode"]["limits"] == {"num_pages": 4096 // PAGE_SIZE}


def test_the_planner_keeps_each_layouts_best_step_settings() -> None:
    # One core: a decoder at nice 0 stepping back to back starves the prefill instance (nice
    # 10); each 256-token chunk pays the 20 ms intercept again. Paced decode steps and
    # whole-prompt prefill steps each give prefill more of the core, and both together most.
    cost = dataclasses.replace(
        affine(),
        transfer_coefficients=(0.0, 0.0),
        role_coefficients=(
            ("decode", (0.01, 0.0, 0.0, 0.0005, 0.0)),
            ("prefill", (0.02, 1e-4, 0.0, 0.0, 0.0)),
        ),
        shared_cores=SharedCores(1, (("prefill", 10),)),
    )
    workload = Workload(
        2.0, 60, LengthDist.parse("fixed:512"), LengthDist.parse("fixed:32"), seed=1
    )

    def best(**search: Any) -> planner.Candidate:
        spec = PlanSpec(
            workload,
            SLO(ttft_s=2.0, tpot_s=0.05),
            2,
            tp_choices=(1,),
            include_mixed=False,
            limits=EngineLimits(max_num_seqs=16, max_num_batched_tokens=256),
            bisect_steps=4,
            min_duration_s=10.0,
            **search,
        )
        (only,) = plan(cost, spec)  # 1P:1D: the one layout of two instances
        return only

    plain = best()
    paced = best(step_intervals_s=(0.0, 0.03))
    whole = best(prompt_budgets=(256, 2048))
    both = best(prompt_budgets=(256, 2048), step_intervals_s=(0.0, 0.03))
    assert 0 < plain.goodput < min(paced.goodput, whole.goodput) <= both.goodput
    assert both.settings is not None and both.settings.label(both.layout) == "2048 tok, 30 ms"
    # The decoder keeps the first budget; the prefill instance is never paced.
    assert both.settings.limits.max_num_batched_tokens == 256
    assert both.settings.prefill.min_step_interval_s == 0
    assert "2048 tok, 30 ms" in format_table([both], top=1, settings=True)


def test_the_emitted_config_and_helm_values_hold_each_roles_planned_step_settings() -> None:
    cost = create_cost_model(LLAMA_H200)
    layout = Layout(num_prefill=1, num_decode=1, tp_prefill=2, tp_decode=2)
    decode = EngineLimits(max_num_batched_tokens=512, min_step_interval_s=0.03)
    prefill = EngineLimits(max_num_batched_tokens=8192)
    raw = checked_cluster_config(layout, decode, cost, prefill_limits=prefill)
    values = helm_values(layout, decode, cost=cost, prefill_limits=prefill)
    assert values is not None
    for config in (ClusterConfig.from_dict(raw), _rendered_config(values)):
        served_decode = limits_of(config, "decode", cost)
        served_prefill = limits_of(config, "prefill", cost)
        assert served_decode.max_num_batched_tokens == 512
        assert served_decode.min_step_interval_s == pytest.approx(0.03)
        assert served_prefill.max_num_batched_tokens == 8192
        assert served_prefill.min_step_interval_s == 0
    mixed = checked_cluster_config(Layout(num_mixed=2, tp_mixed=2), decode, cost)
    assert mixed["limits"]["max_num_batched_tokens"] == 512
    assert mixed["groups"]["mixed"]["limits"]["min_step_interval_ms"] == pytest.approx(30)


@pytest.mark.parametrize(
    ("given", "chart_name"),
    [("verbs", "verbs;ofi_rxm"), ("verbs;ofi_rxm", "verbs;ofi_rxm"), ("efa", "efa")],
)
def test_helm_values_name_the_provider_as_the_chart_does(given: str, chart_name: str) -> None:
    layout = Layout(num_prefill=2, num_decode=1, tp_prefill=4, tp_decode=8)
    values = helm_values(layout, EngineLimits(), provider=given)
    assert values is not None and values["fabric"]["provider"] == chart_name
    config = _rendered_config(values)
    assert config.group("decode").fabric is not None
    assert config.group("decode").fabric.provider == chart_name


def test_helm_values_refuse_shm_and_a_model_path_outside_the_pods() -> None:
    layout = Layout(num_prefill=1, num_decode=1)
    with pytest.raises(ConfigError, match="shm moves KV within one node"):
        helm_values(layout, EngineLimits(), provider="shm")
    with pytest.raises(ConfigError, match="absolute path"):
        helm_values(layout, EngineLimits(), model_path="models/llama")


def test_plan_emits_helm_values_the_chart_deploys_as_planned(tmp_path: Path) -> None:
    config_path, helm_path = tmp_path / "cluster.yaml", tmp_path / "values.yaml"
    argv = [*PLAN, "--no-mixed", "--provider", "verbs", "--model-path", "/data/llama",
            "--emit-config", str(config_path), "--emit-helm", str(helm_path)]  # fmt: skip
    assert main(argv) == 0
    cost = create_cost_model(PLAN[PLAN.index("--cost") + 1])
    emitted = ClusterConfig.from_yaml(config_path)
    deployed = _rendered_config(yaml.safe_load(helm_path.read_text()))
    assert str(deployed.model) == str(emitted.model) == "/data/llama"  # not the chart's default
    for config in (emitted, deployed):
        for role in ("prefill", "decode"):
            group = config.group(role)
            assert group.fabric is not None and group.fabric.provider == "verbs;ofi_rxm"
            assert group.limits.num_pages == cost.kv_capacity_tokens(group.tp) // PAGE_SIZE


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--provider", "shm"], "shm moves KV within one node"),
        (["--model-path", "models/llama"], "absolute path"),
    ],
)
def test_plan_refuses_helm_values_the_chart_cannot_deploy_before_searching(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    helm_path = tmp_path / "values.yaml"
    assert main([*PLAN, *flags, "--emit-helm", str(helm_path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("pdserve plan: --emit-helm: ") and message in captured.err
    assert "goodput" not in captured.out and not helm_path.exists()


def test_the_rival_is_the_best_layout_of_the_other_kind_with_a_goodput() -> None:
    settings = planner.RoleLimits(EngineLimits(), EngineLimits())

    def candidate(layout: Layout, goodput: float) -> planner.Candidate:
        return planner.Candidate(layout, goodput, None, settings)

    pick = candidate(Layout(num_prefill=1, num_decode=2), 7.0)
    same_kind = candidate(Layout(num_prefill=2, num_decode=1), 6.9)
    what_if = candidate(Layout(num_prefill=1, num_decode=2, ep_decode=2), 6.8)
    mixed = candidate(Layout(num_mixed=2), 6.7)
    worse_mixed = candidate(Layout(num_mixed=3), 5.0)
    assert planner.rival([pick, same_kind, what_if, mixed, worse_mixed]) is mixed
    # A mixed pick's rival is disaggregated; none of the other kind with a goodput: None.
    assert planner.rival([mixed, worse_mixed, same_kind]) is same_kind
    assert planner.rival([pick, same_kind, candidate(Layout(num_mixed=2), 0.0)]) is None
    assert planner.rival([]) is None
