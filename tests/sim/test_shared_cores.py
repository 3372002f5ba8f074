"""Worker processes sharing one machine's cores (`orchestrator.sim.shared_cores`): shares by
CPU priority, traced cycles turned into core-seconds (``pdserve calibrate --from-trace
--shared-cores``), the simulator stretching each step by its share, and the planner ranking
layouts of one machine by goodput."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from orchestrator.cli.main import main
from orchestrator.config.cluster import ClusterConfig
from orchestrator.sim.calibrated import CalibratedCostModel, load
from orchestrator.sim.cost import StepShape
from orchestrator.sim.emit import checked_cluster_config, helm_values
from orchestrator.sim.instances import EngineLimits
from orchestrator.sim.metrics import SLO
from orchestrator.sim.planner import PlanSpec, plan
from orchestrator.sim.shared_cores import (
    ProcessorSharing,
    SharedCores,
    alone_seconds,
    core_shares,
    nice_weight,
)
from orchestrator.sim.simulator import Layout, Simulator
from orchestrator.sim.workload import LengthDist, RequestSpec, Workload
from tests.sim.test_trace_fit import (
    DECODE_LAW,
    DECODE_SHAPES,
    MIXED_LAW,
    MIXED_SHAPES,
    PREFILL_LAW,
    PREFILL_SHAPES,
    _price,
    _trace,
)
from tests.sim.toy import affine

PREFILL_NICE = 10


def test_shares_follow_the_weights_and_no_process_gets_more_than_a_core() -> None:
    assert nice_weight(0) == 1024 and nice_weight(10) == pytest.approx(110, abs=0.5)
    assert core_shares([1024] * 3, 2) == pytest.approx([2 / 3] * 3)
    assert core_shares([1024] * 2, 2) == [1.0, 1.0]
    assert core_shares([1024, 1024], 1) == pytest.approx([0.5, 0.5])
    # The decoder at nice 0 beside two prefill workers at nice 10: it gets a whole core, and
    # the two split the other; on one core it gets 1024 / (1024 + 2 * 110) of it.
    weights = [1024, nice_weight(10), nice_weight(10)]
    assert core_shares(weights, 2) == pytest.approx([1.0, 0.5, 0.5])
    assert core_shares(weights, 1)[0] == pytest.approx(1024 / (1024 + 2 * nice_weight(10)))
    for cores in (0.5, 1, 1.5, 2, 3):
        assert sum(core_shares(weights, cores)) == pytest.approx(min(cores, 3))


def test_cycles_become_the_core_seconds_their_worker_got() -> None:
    # One core. A steps 0-1 and 2-3; B steps 0-2; C (weight 3) steps 2.5-3.5.
    workers = [(1.0, [(0.0, 1.0), (2.0, 1.0)]), (1.0, [(0.0, 2.0)]), (3.0, [(2.5, 1.0)])]
    a, b, c = alone_seconds(workers, cores=1)
    assert a == pytest.approx([0.5, 0.5 + 0.5 * 0.25])  # alone 2-2.5, a quarter 2.5-3
    assert b == pytest.approx([0.5 + 1.0])  # half of 0-1, all of 1-2
    assert c == pytest.approx([0.5 * 0.75 + 0.5])
    assert sum(a) + sum(b) + sum(c) == pytest.approx(3.5)  # busy one core from 0 to 3.5
    assert alone_seconds(workers, cores=3) == [[1.0, 1.0], [2.0], [1.0]]


def _document(tmp_path: Path, tiny_model_dir: Path, prefill_nice: int = PREFILL_NICE) -> Path:
    """A disaggregated run (prefill at ``prefill_nice`` and decode, stepping from the same
    instant) and a colocated one, with their configs."""
    tmp_path = tmp_path / f"nice-{prefill_nice}"
    tmp_path.mkdir(exist_ok=True)
    configs = {}
    for name, groups in (
        ("disaggregated", {"prefill": {"nice": prefill_nice}, "decode": {}}),
        ("colocated", {"mixed": {}}),
    ):
        configs[name] = str(tmp_path / f"{name}.yaml")
        Path(configs[name]).write_text(
            yaml.safe_dump({"model": str(tiny_model_dir), "groups": groups})
        )
    runs = [
        {"name": "disaggregated", "step_traces": [
            _trace("prefill", PREFILL_LAW, PREFILL_SHAPES), _trace("decode", DECODE_LAW, DECODE_SHAPES),
        ]},
        {"name": "colocated", "step_traces": [_trace("mixed", MIXED_LAW, MIXED_SHAPES)]},
    ]  # fmt: skip
    path = tmp_path / "compare.json"
    path.write_text(json.dumps({"command": "compare", "configs": configs, "runs": runs}))
    return path


def _calibrate(document: Path, out: Path, cores: str) -> dict[str, list[list[float]]]:
    argv = ["calibrate", "--from-trace", str(document), "--shared-cores", cores, "--out", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    roles: dict[str, list[list[float]]] = data["roles"]
    return roles


def test_calibrate_fits_core_seconds_and_the_model_prices_each_layouts_share(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    document = _document(tmp_path, tiny_model_dir)
    # Two cores for at most two workers a run: every cycle had a core, the laws come back.
    roomy = tmp_path / "roomy.json"
    _calibrate(document, roomy, "2")
    assert "core-seconds of 2 shared cores" in capsys.readouterr().out
    model = load(roomy)
    assert model.shared_cores is not None
    assert dict(model.shared_cores.role_nice) == {"prefill": PREFILL_NICE, "decode": 0, "mixed": 0}
    fits = dict(model.role_coefficients)
    shape = [200, 200 * 300 + 200 * 201 // 2, 5, 2500]
    for role, law in (("prefill", PREFILL_LAW), ("decode", DECODE_LAW), ("mixed", MIXED_LAW)):
        assert fits[role] == pytest.approx(law, rel=1e-6, abs=1e-12), role
        alone = model.step_seconds(StepShape(*shape), 1, role=role)
        assert alone == pytest.approx(_price(law, shape))
    # Priced on those two cores: three mixed instances each get two thirds of one; a decoder
    # beside two nice prefill workers keeps its core, and they split the other.
    step = StepShape(*shape)
    assert model.step_seconds(step, 1, ("mixed", "mixed"), "mixed") == pytest.approx(
        1.5 * _price(MIXED_LAW, shape)
    )
    assert model.step_seconds(step, 1, ("prefill", "prefill"), "decode") == pytest.approx(
        _price(DECODE_LAW, shape)
    )
    assert model.step_seconds(step, 1, ("prefill", "decode"), "prefill") == pytest.approx(
        2 * _price(PREFILL_LAW, shape)
    )
    # One core: where the prefill and decode cycles overlapped, each got a share of it, so
    # its core-seconds are fewer than its seconds; the colocated run had the core alone.
    tight = _calibrate(document, tmp_path / "tight.json", "1")
    measured = json.loads(roomy.read_text())["roles"]
    assert tight["mixed"] == measured["mixed"]
    for role in ("prefill", "decode"):
        pairs = list(zip(tight[role], measured[role], strict=True))
        assert all(t[-1] <= m[-1] + 1e-12 for t, m in pairs)
        assert any(t[-1] < 0.95 * m[-1] for t, m in pairs), role
    # The decoder's higher weight: it lost less of its time than the prefill worker did.
    lost = {
        role: 1 - sum(p[-1] for p in tight[role]) / sum(p[-1] for p in measured[role])
        for role in ("prefill", "decode")
    }
    assert 0 < lost["decode"] < lost["prefill"]


def test_shared_cores_need_traces_a_positive_count_and_one_nice_per_role(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.json"
    assert main(["calibrate", "--shared-cores", "2", "--out", str(out)]) == 2
    assert "--shared-cores needs --from-trace" in capsys.readouterr().err
    document = _document(tmp_path, tiny_model_dir)
    argv = ["calibrate", "--from-trace", str(document), "--out", str(out)]
    assert main([*argv, "--shared-cores", "0"]) == 2
    assert "--shared-cores must be > 0, got 0.0" in capsys.readouterr().err
    assert not out.exists()
    # Runs whose prefill groups had other priorities: fine as measured, not as core-seconds.
    other = _document(tmp_path, tiny_model_dir, prefill_nice=0)
    both = ["calibrate", "--from-trace", str(document), str(other), "--out", str(out)]
    assert main(both) == 0
    assert main([*both, "--shared-cores", "2"]) == 2
    assert "prefill groups run at different nice levels" in capsys.readouterr().err


def _on_cores(cores: float) -> SharedCores:
    return SharedCores(cores, (("prefill", PREFILL_NICE),))


def _toy(cores: float | None) -> CalibratedCostModel:
    return dataclasses.replace(
        affine(),
        transfer_coefficients=(0.0, 0.0),
        role_coefficients=(
            ("decode", (0.01, 0.0, 0.0, 0.0, 0.0)),
            ("mixed", (0.3, 0.0, 0.0, 0.0, 0.0)),
            ("prefill", (0.2, 0.0, 0.0, 0.0, 0.0)),
        ),
        shared_cores=None if cores is None else _on_cores(cores),
    )


def test_the_simulator_stretches_steps_that_share_the_cores() -> None:
    limits = EngineLimits(max_num_seqs=8, max_num_batched_tokens=256)
    together = [RequestSpec(i, 0.0, 200, 2) for i in range(3)]  # one chunk each
    ttfts = {}
    for cores in (None, 3, 2, 1):
        result = Simulator(_toy(cores), Layout(num_mixed=3), limits).run(together)
        ttfts[cores] = sorted(r.ttft for r in result.records)
    # Three steps of 0.3 core-seconds in progress together, each at its share of the cores.
    assert ttfts[None] == ttfts[3] == pytest.approx([0.3] * 3)
    assert ttfts[2] == pytest.approx([0.45] * 3)  # 2/3 of a core each
    assert ttfts[1] == pytest.approx([0.9] * 3)  # a third each


def test_a_step_in_progress_slows_when_another_starts_beside_it() -> None:
    limits = EngineLimits(max_num_seqs=8, max_num_batched_tokens=256)
    staggered = [RequestSpec(0, 0.0, 200, 1), RequestSpec(1, 0.1, 200, 1)]  # prefill only
    result = Simulator(_toy(1), Layout(num_mixed=2), limits).run(staggered)
    # On one core: the first chunk runs alone for 0.1 s, both then run at half a core until
    # the first ends at 0.5 (0.2 core-seconds left at half speed), the second alone to 0.6.
    # Priced once at its start the first would have kept its whole core and ended at 0.3.
    assert [r.ttft for r in result.records] == pytest.approx([0.5, 0.5])
    assert sum(result.busy_seconds) == pytest.approx(0.5 + 0.5)


def test_processor_sharing_divides_by_priority_and_conserves_core_seconds() -> None:
    sharing = ProcessorSharing(_on_cores(2))
    ((_, _, alone),) = sharing.start("d", "decode", 1.0, 0.0)
    assert alone == pytest.approx(1.0)
    sharing.start("p1", "prefill", 0.5, 0.0)
    ends = {key: (version, time) for key, version, time in sharing.start("p2", "prefill", 0.5, 0.0)}
    # The decoder at nice 0 keeps its core; the two prefill steps at nice 10 share the other.
    assert ends["d"][1] == pytest.approx(1.0)
    assert ends["p1"][1] == ends["p2"][1] == pytest.approx(1.0)
    # An end time set before the last re-division is stale.
    assert sharing.end("p1", ends["p1"][0] - 1, 1.0) is None
    seconds, others = sharing.end("p1", ends["p1"][0], 1.0) or (0.0, [])
    assert seconds == pytest.approx(1.0)
    assert {key for key, _, _ in others} == {"d", "p2"}


def test_on_shared_cores_the_planner_ranks_by_goodput_not_per_instance() -> None:
    workload = Workload(2.0, 60, LengthDist.parse("fixed:200"), LengthDist.parse("fixed:4"), seed=1)
    spec = PlanSpec(
        workload,
        SLO(ttft_s=1.0, tpot_s=0.5),
        gpu_budget=3,
        tp_choices=(1,),
        limits=EngineLimits(max_num_seqs=8, max_num_batched_tokens=256),
        bisect_steps=4,
        min_duration_s=10.0,
    )
    shared = plan(_toy(2), spec)
    goodputs = [c.goodput for c in shared]
    assert goodputs == sorted(goodputs, reverse=True) and goodputs[0] > 0
    own = plan(_toy(None), spec)
    per_gpu = [c.goodput_per_gpu for c in own]
    assert per_gpu == sorted(per_gpu, reverse=True)
    # Three mixed instances on two cores serve more than one, but less than three times one.
    by_label = {c.layout.label: c.goodput for c in shared}
    assert by_label["1M(tp1)"] < by_label["3M(tp1)"] < 3 * by_label["1M(tp1)"]


def test_a_plan_on_shared_cores_emits_a_cpu_config_with_the_planned_priorities(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cost = _toy(2)
    limits = EngineLimits(max_num_seqs=8, max_num_batched_tokens=256)
    raw = checked_cluster_config(Layout(num_prefill=2, num_decode=1), limits, cost, provider="shm")
    config = ClusterConfig.from_dict(raw)
    assert config.device == "cpu"
    prefill, decode = config.group("prefill"), config.group("decode")
    assert (prefill.replicas, prefill.nice, decode.nice) == (2, 10, 0)
    assert prefill.resources_per_rank.cpu == decode.resources_per_rank.cpu == 0.66  # 2 of 3
    assert prefill.resources_per_rank.gpu == 0
    with pytest.raises(ValueError, match="shared CPU cores: the chart's pods run on GPU nodes"):
        helm_values(Layout(num_prefill=2, num_decode=1), limits, cost=cost, provider="efa")
    # The command: refused before its search; a plain provider is fine on CPUs.
    calibration = tmp_path / "shared.json"
    _calibrate(_document(tmp_path, tiny_model_dir), calibration, "2")
    argv = [
        "plan", "--cost", f"calibrated:{calibration}", "--gpus", "2", "--tp", "1",
        "--prompt", "fixed:64", "--output", "fixed:8", "--rate", "2", "--num-requests", "40",
        "--provider", "tcp;ofi_rxm", "--model-path", str(tiny_model_dir),
    ]  # fmt: skip
    assert main([*argv, "--emit-helm", str(tmp_path / "values.yaml")]) == 2
    assert "--emit-helm: a plan on one machine's shared CPU cores" in capsys.readouterr().err
    assert main([*argv, "--emit-config", str(tmp_path / "planned.yaml")]) == 0
    assert "every layout on the same 2 shared cores" in capsys.readouterr().out
    planned = ClusterConfig.from_yaml(tmp_path / "planned.yaml")
    assert planned.device == "cpu"
