"""Step costs fitted per worker role to the step traces of measured runs
(`orchestrator.sim.trace_fit`, ``pdserve calibrate --from-trace``), and the simulator pricing
each instance with its own role's fit."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from orchestrator.cli.main import main
from orchestrator.config.cluster import ClusterConfig
from orchestrator.loadgen.validate import predict
from orchestrator.sim.calibrated import CalibratedCostModel, load
from orchestrator.sim.cost import StepShape
from orchestrator.sim.instances import EngineLimits
from orchestrator.sim.noise import Spread, StepNoise
from orchestrator.sim.simulator import Layout, Simulator
from orchestrator.sim.trace_fit import busy_cycles
from orchestrator.sim.workload import RequestSpec
from tests.sim.toy import affine

# Known laws the traces below follow exactly: seconds = a + b*tokens + c*attention + d*seqs + e*kv.
PREFILL_LAW = (0.02, 4e-4, 3e-7, 0.0, 0.0)
DECODE_LAW = (0.012, 0.0, 0.0, 9e-4, 2e-6)
MIXED_LAW = (0.015, 3e-4, 2e-7, 1e-3, 3e-6)


def _price(law: tuple[float, ...], shape: list[float]) -> float:
    return law[0] + sum(c * x for c, x in zip(law[1:], shape, strict=True))


def _trace(role: str, law: tuple[float, ...], shapes: list[list[float]]) -> dict[str, Any]:
    """Steps run back to back at the law's cycle times, then an idle wait, then one more;
    each step's own duration is its cycle's (no work between steps)."""
    records, now = [], 0.0
    for i, shape in enumerate(shapes):
        if i == len(shapes) - 1:
            now += 5.0  # idle: the step before it ends no busy cycle
        price = _price(law, shape)
        records.append([now, price, 1.0 if i in (0, len(shapes) - 1) else 0.0, *shape])
        now += price
    return {"worker_id": f"{role}-0", "role": role, "records": records}


PREFILL_SHAPES = [
    [n, n * c + n * (n + 1) // 2, 0, 0] for n in (64, 128, 256) for c in (0, 256, 1024)
]
DECODE_SHAPES = [[0, 0, b, b * k] for b in (1, 4, 16) for k in (100, 500, 900)]
MIXED_SHAPES = [
    [n, n * c + n * (n + 1) // 2, b, b * k]
    for n, c, b, k in [(0, 0, 4, 300), (0, 0, 12, 800), (240, 0, 0, 0), (128, 512, 0, 0),
                       (200, 256, 6, 500), (64, 0, 2, 1500), (250, 768, 16, 400), (0, 0, 1, 50)]
]  # fmt: skip


def _document(
    tmp_path: Path, tiny_model_dir: Path, traces: bool = True, rate: float | None = None
) -> Path:
    config = tmp_path / "disagg.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(tiny_model_dir), "dtype": "float32", "page_size": 16,
        "limits": {"num_pages": 128, "max_num_batched_tokens": 256},
        "groups": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
    }))  # fmt: skip
    runs = [
        {"name": "disaggregated", "step_traces": [
            _trace("prefill", PREFILL_LAW, PREFILL_SHAPES),
            _trace("decode", DECODE_LAW, DECODE_SHAPES),
            {"worker_id": "decode-1", "role": "decode", "error": "RayActorError()"},
        ]},
        {"name": "colocated", "step_traces": [_trace("mixed", MIXED_LAW, MIXED_SHAPES)]},
    ]  # fmt: skip
    if not traces:
        for run in runs:
            del run["step_traces"]
    path = tmp_path / "compare.json"
    document: dict[str, Any] = {
        "command": "compare",
        "configs": {"disaggregated": str(config)},
        "runs": runs,
    }
    if rate is not None:
        document["workload"] = {"rate": rate, "prompt": "uniform:100-200"}
    path.write_text(json.dumps(document))
    return path


def test_busy_cycles_run_from_one_start_to_the_next_without_a_wait_else_a_step() -> None:
    trace = {"records": [
        [0.00, 0.01, 1.0, 32, 528, 0, 0],
        [0.02, 0.01, 0.0, 0, 0, 2, 90],
        [0.05, 0.01, 0.0, 0, 0, 2, 92],
        [1.00, 0.01, 1.0, 0, 0, 1, 7],
        [1.03, 0.01, 0.0, 0, 0, 1, 8],
    ]}  # fmt: skip
    starts, cycles = zip(*busy_cycles(trace), strict=True)
    assert starts == (0.00, 0.02, 0.05, 1.00, 1.03)
    assert [c[:4] for c in cycles] == [
        [32, 528, 0, 0], [0, 0, 2, 90], [0, 0, 2, 92], [0, 0, 1, 7], [0, 0, 1, 8],
    ]  # fmt: skip
    # A cycle to the next start; before an idle wait, and last, the step's own duration.
    assert [c[4] for c in cycles] == pytest.approx([0.02, 0.03, 0.01, 0.03, 0.01])


def test_calibrate_from_traces_recovers_each_roles_law(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "traced.json"
    argv = [
        "calibrate",
        "--from-trace",
        str(_document(tmp_path, tiny_model_dir)),
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "decode" in printed and "mixed" in printed and str(out) in printed
    data = json.loads(out.read_text())
    # The tiny preset: 4 layers, 2 KV heads of 32, float32; the config's pool.
    assert (data["num_layers"], data["kv_bytes_per_token"]) == (4, 2 * 4 * 2 * 32 * 4)
    assert data["kv_capacity_tokens"] == 128 * 16
    # A point per step: the two that no busy cycle follows (before the idle wait, and the
    # last) by their own duration.
    assert {role: len(points) for role, points in data["roles"].items()} == {
        "prefill": len(PREFILL_SHAPES),
        "decode": len(DECODE_SHAPES),
        "mixed": len(MIXED_SHAPES),
    }
    model = load(out)
    fits = dict(model.role_coefficients)
    for role, law in (("prefill", PREFILL_LAW), ("decode", DECODE_LAW), ("mixed", MIXED_LAW)):
        assert fits[role] == pytest.approx(law, rel=1e-6, abs=1e-12), role
        shape = [200, 200 * 300 + 200 * 201 // 2, 5, 2500]
        price = model.step_seconds(StepShape(*shape), 1, busy_others=("mixed",) * 2, role=role)
        assert price == pytest.approx(_price(law, shape)), role  # contention plays no part
    # Without a traced role: the fits of the prefill-only and decode-only cycles of all roles.
    assert model.prefill_coefficients[1] > 0 and model.decode_coefficients[1] > 0
    assert model.step_seconds(StepShape(256, 256 * 257 // 2), 1, role="unknown") == (
        model.step_seconds(StepShape(256, 256 * 257 // 2), 1)
    )


def test_a_calibration_warns_of_rates_far_from_the_load_it_was_traced_at(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "traced.json"
    traced = _document(tmp_path, tiny_model_dir, rate=0.75)
    assert main(["calibrate", "--from-trace", str(traced), "--out", str(out)]) == 0
    assert load(out).traced_rates == (0.75,)
    capsys.readouterr()
    simulate = ["simulate", "--cost", f"calibrated:{out}", "--layout", "1x1:1x1",
                "--num-requests", "20", "--prompt", "fixed:64", "--output", "fixed:8"]  # fmt: skip
    for rate, warned in (("1.0", False), ("0.4", True), ("3", True)):
        assert main([*simulate, "--rate", rate]) == 0
        err = capsys.readouterr().err
        assert ("traced at 0.75 req/s" in err) == warned, rate
        assert ("--rate " + rate in err) == warned  # how to trace near the asked load
    # A plan warns of the best layout's goodput, which it cannot know before it searches.
    plan = ["plan", "--cost", f"calibrated:{out}", "--gpus", "2", "--tp", "1", "--no-mixed",
            "--num-requests", "20", "--prompt", "fixed:64", "--output", "fixed:8",
            "--min-duration", "2", "--model-path", str(tiny_model_dir)]  # fmt: skip
    assert main(plan) == 0
    captured = capsys.readouterr()
    assert "1P(tp1):1D(tp1)'s goodput: the calibration's steps were traced at 0.75" in (
        captured.err
    )


def test_calibrate_from_traces_refuses_results_without_them(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "traced.json"
    bare = _document(tmp_path, tiny_model_dir, traces=False)
    assert main(["calibrate", "--from-trace", str(bare), "--out", str(out)]) == 2
    assert "no step traces" in capsys.readouterr().err
    traced = _document(tmp_path, tiny_model_dir)
    argv = ["calibrate", "--from-trace", str(traced), "--out", str(out), "--fabric"]
    assert main([*argv, "--concurrent", "3"]) == 2
    assert "measures nothing: --fabric, --concurrent unused" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"command": "run", "runs": []}))
    assert main(["calibrate", "--from-trace", str(other), "--out", str(out)]) == 2
    assert "not a pdserve bench compare result" in capsys.readouterr().err
    assert not out.exists()


def test_the_simulator_prices_each_instance_with_its_roles_fit() -> None:
    model = dataclasses.replace(
        affine(),
        transfer_coefficients=(0.0, 0.0),
        role_coefficients=(
            ("decode", (0.01, 0.0, 0.0, 0.0, 0.0)),
            ("mixed", (0.5, 0.0, 0.0, 0.0, 0.0)),
            ("prefill", (1.0, 0.0, 0.0, 0.0, 0.0)),
        ),
    )
    limits = EngineLimits(max_num_seqs=8, max_num_batched_tokens=256)
    request = [RequestSpec(0, 0.0, 257, 3)]  # 256 tokens to prefill: one prefill step
    disaggregated = Simulator(model, Layout(num_prefill=1, num_decode=1), limits).run(request)
    (record,) = disaggregated.records
    assert record.kv_ready_time - record.prefill_start_time == pytest.approx(1.0, rel=1e-3)
    assert record.ttft == pytest.approx(1.0 + 0.01, rel=1e-3)  # and its first decode step
    assert record.tpot == pytest.approx(0.01)
    mixed = Simulator(model, Layout(num_mixed=1), limits).run(request)
    (record,) = mixed.records
    assert record.ttft == pytest.approx(2 * 0.5)  # 257 tokens: two chunks of the budget
    assert record.tpot == pytest.approx(0.5)


def test_step_noise_adds_draws_from_its_residuals_reproducibly() -> None:
    spreads = {("decode", "decode"): Spread(0.5, (-0.004, 0.0, 0.02))}
    decode_step = StepShape(num_decode_seqs=2, num_decode_kv_tokens=40)

    def draws(seed: int, seconds: float = 0.01) -> list[float]:
        noise = StepNoise(spreads, seed)
        return [noise.apply("decode", decode_step, seconds) for _ in range(2000)]

    assert draws(7) == draws(7) and draws(7) != draws(8)
    values = np.array(draws(7))
    assert values.min() >= 0.006 and values.max() <= 0.03
    # Half the draws fall between the first two residuals (-4..0 ms), half above 0.
    assert np.mean(values < 0.01) == pytest.approx(0.5, abs=0.05)
    # In seconds: a 1 s step gets the same delays as a 10 ms one, not 100 times as much.
    assert np.array(draws(7, 1.0)) - 1.0 == pytest.approx(values - 0.01)
    # A residual of a longer step never takes a short one under floor x its price.
    assert min(draws(7, 0.002)) == pytest.approx(0.001)
    noise = StepNoise(spreads, 0)
    assert noise.apply("decode", StepShape(16, 136), 0.3) == 0.3  # no spread for that kind
    assert noise.apply("prefill", decode_step, 0.3) == 0.3
    with pytest.raises(ValueError, match="increasing residual"):
        Spread(1.0, (0.01, -0.01))
    with pytest.raises(ValueError, match="floor"):
        Spread(0.0, (-0.01, 0.01))


def test_traced_spread_reaches_the_simulated_itl_tail(tmp_path: Path, tiny_model_dir: Path) -> None:
    # Decode cycles that follow the law, except every tenth stalls 30 ms longer.
    shapes = [[0, 0, b, b * k] for b in (1, 2, 4, 8) for k in range(100, 1100, 40)]
    trace = _trace("decode", DECODE_LAW, shapes)
    for i, record in enumerate(trace["records"][:-1]):
        stall = 0.03 if i % 10 == 9 else 0.0
        trace["records"][i + 1][0] = record[0] + _price(DECODE_LAW, record[3:]) + stall
    trace["records"][-1][2] = 0.0  # no idle wait: every record but the last ends a cycle
    path = _document(tmp_path, tiny_model_dir)
    document = json.loads(path.read_text())
    document["runs"][0]["step_traces"][1] = trace
    path.write_text(json.dumps(document))
    out = tmp_path / "traced.json"
    assert main(["calibrate", "--from-trace", str(path), "--out", str(out)]) == 0
    model = load(out)
    spread = model.step_noise()[("decode", "decode")]
    # The fit takes the mean stall (3 ms) into its terms; the residuals keep the stall.
    assert spread.residuals[-1] - spread.residuals[0] == pytest.approx(0.03, abs=0.002)
    assert spread.residuals[50] < 0 < spread.residuals[95]
    assert ("prefill", "prefill") not in model.step_noise()  # 7 cycles: too few for a spread

    requests = [RequestSpec(i, 0.2 * i, 20, 60) for i in range(20)]
    limits = EngineLimits(max_num_seqs=8, max_num_batched_tokens=256)
    layout = Layout(num_prefill=1, num_decode=1)

    def itl_p99(cost: CalibratedCostModel, seed: int = 0) -> float:
        result = Simulator(cost, layout, limits, seed=seed).run(requests)
        return float(np.percentile(np.concatenate([r.itl_gaps for r in result.records]), 99))

    steady = dataclasses.replace(model, step_noise_spreads=())
    # The stalled tenth of steps is the tail: about 30 ms over the steady p99.
    assert itl_p99(model) > itl_p99(steady) + 0.02
    assert itl_p99(model, seed=3) == itl_p99(model, seed=3)

    # Predictions over several seeds: each figure is the median of one run per seed.
    config = ClusterConfig.from_yaml(tmp_path / "disagg.yaml")
    single = [predict(model, config, requests, 0, seeds=(seed,)) for seed in range(3)]
    assert predict(model, config, requests, 0, seeds=range(3)) == {
        key: float(np.median([p[key] for p in single])) for key in single[0]
    }
