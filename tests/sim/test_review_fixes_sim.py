"""Review fixes of the simulator, planner and their emitted configs: the KV pool and model path
the emitted config and Helm values carry, Helm provider names, TP sizes a model cannot run,
SLO and calibration numbers that are not positive finite seconds, calibrate's mixed points,
and the percentile definition the simulator shares with the load generator."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import helm_python as helm
import numpy as np
import pytest
import yaml

from orchestrator.cli import main
from orchestrator.config import ClusterConfig, ConfigError
from orchestrator.loadgen.stats import distribution
from orchestrator.loadgen.validate import limits_of
from orchestrator.sim.calibrate import BUDGET, check_options
from orchestrator.sim.calibrated import load
from orchestrator.sim.cost import create_cost_model
from orchestrator.sim.emit import PAGE_SIZE, checked_cluster_config, helm_values
from orchestrator.sim.instances import EngineLimits, chunk_tokens
from orchestrator.sim.metrics import SLO, summarize
from orchestrator.sim.simulator import (
    Layout,
    RequestRecord,
    SimResult,
    Simulator,
    UnsupportedLayoutError,
)
from tests.ops.test_helm import CHART, NAMESPACE, RELEASE, cluster_yaml
from tests.sim.test_cli import PLAN, SIMULATE
from tests.sim.test_cost_models import _fit_data

LLAMA_H200 = "roofline:llama-3-70b:h200"


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


# --- 1-3: the emitted config and Helm values ------------------------------------------------


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


# --- 4: TP sizes the model cannot run -------------------------------------------------------


@pytest.mark.parametrize("layout", ["1x3:1x3", "1x16:1x16", "1x1:1x1", "2x3"])
def test_simulate_refuses_tp_sizes_the_model_cannot_run(
    layout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate", "--cost", LLAMA_H200, "--layout", layout,
            "--num-requests", "10", "--prompt", "fixed:500", "--output", "fixed:8"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve simulate: ") and "does not run at TP" in err
    assert err.count("\n") == 1  # one line, no traceback


def test_a_simulator_of_an_unsupported_layout_is_a_typed_error() -> None:
    cost = create_cost_model(LLAMA_H200)
    with pytest.raises(UnsupportedLayoutError, match="TP 1"):
        Simulator(cost, Layout(num_prefill=1, num_decode=1, tp_prefill=2, tp_decode=1))
    Simulator(cost, Layout(num_prefill=1, num_decode=1, tp_prefill=2, tp_decode=2))


# --- 5: SLOs --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bounds",
    [(2.0, 0.05, 0.0), (2.0, 0.05, math.nan), (math.nan, 0.05, None), (2.0, math.nan, None),
     (2.0, math.inf, None), (2.0, 0.05, -1.0)],
)  # fmt: skip
def test_slos_must_be_positive_finite_seconds(bounds: tuple[float, float, float | None]) -> None:
    with pytest.raises(ValueError, match="SLOs must be positive"):
        SLO(*bounds)


@pytest.mark.parametrize("bound", ["0", "nan"])
def test_simulate_refuses_a_stall_bound_that_is_not_positive(
    bound: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*SIMULATE, "--max-itl-slo", bound]) == 2
    assert capsys.readouterr().err.startswith("pdserve simulate: SLOs must be positive")


# --- 6: calibration numbers -----------------------------------------------------------------


def _calibration_text(**changes: Any) -> str:
    data = _fit_data()
    for key, value in changes.items():
        data[key] = value
    return json.dumps(data)  # NaN and Infinity as JSON's extensions, as json.loads reads them


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            _calibration_text(
                prefill=[{**point, "seconds": math.nan} for point in _fit_data()["prefill"]]
            ),
            "must be finite",
        ),
        (
            _calibration_text(
                decode=[{**point, "seconds": math.inf} for point in _fit_data()["decode"]]
            ),
            "must be finite",
        ),
        (_calibration_text(overheads={"disaggregated_s": math.nan}), "must be a finite number"),
        # 1e400 is a float's infinity once read: `int` of it raised OverflowError.
        (_calibration_text(kv_bytes_per_token=12345.5).replace("12345.5", "1e400"), "finite"),
        (_calibration_text(num_layers=math.inf), "num_layers must be a finite number"),
        (
            _calibration_text(
                decode=[{**point, "seconds": -1.0} for point in _fit_data()["decode"]]
            ),
            "prices a decode step at 0",
        ),
    ],
    ids=["nan-seconds", "inf-seconds", "nan-overhead", "huge-kv-bytes", "inf-layers", "negative"],
)
def test_calibrations_that_are_not_finite_positive_step_times_are_refused(
    text: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "calibration.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load(path)
    assert main([*SIMULATE, "--cost", f"calibrated:{path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pdserve simulate: {path}: ") and err.count("\n") == 1


@pytest.mark.parametrize("duration", ["inf", "nan"])
def test_plan_refuses_a_min_duration_that_is_not_finite(
    duration: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*PLAN, "--min-duration", duration]) == 2
    assert "min_duration_s must be finite" in capsys.readouterr().err


# --- 10: calibrate's mixed points -----------------------------------------------------------


def test_mixed_batches_must_leave_a_page_for_the_chunk() -> None:
    most = BUDGET - PAGE_SIZE
    # The bound is exact: one more decode leaves no page-aligned chunk, and the point never ends.
    assert chunk_tokens(0, 768, BUDGET - most, PAGE_SIZE) == PAGE_SIZE
    assert chunk_tokens(0, 768, BUDGET - most - 1, PAGE_SIZE) == 0
    check_options(1, None, BUDGET, mixed_batches=(4, most))
    for bad in ((most + 1,), (0, 4), (BUDGET,)):
        with pytest.raises(ValueError, match=f"mixed batches must be 1..{most}"):
            check_options(1, None, BUDGET, mixed_batches=bad)
    with pytest.raises(ValueError, match="decode batches must be >= 1"):
        check_options(1, None, BUDGET, decode_batches=(0, 8))
    with pytest.raises(ValueError, match="decode contexts must be >= 1"):
        check_options(1, None, BUDGET, decode_contexts=(0,))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--mixed-batch", "241"], "mixed batches must be 1..240"),
        (["--decode-batch", "0,8"], "decode batches must be >= 1"),
        (["--decode-context", "-5"], "decode contexts must be >= 1"),
    ],
)
def test_calibrate_refuses_points_it_could_not_measure_before_measuring(
    flags: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import orchestrator.sim.calibrate

    def measure(*args: object, **kwargs: object) -> None:
        pytest.fail("measured points that cannot be measured (a mixed point would hang)")

    monkeypatch.setattr(orchestrator.sim.calibrate, "run_calibration", measure)
    out = tmp_path / "c.json"
    assert main(["calibrate", "--out", str(out), *flags]) == 2
    assert f"pdserve calibrate: {message}" in capsys.readouterr().err
    assert not out.exists()


# --- 11: one percentile definition ----------------------------------------------------------


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
