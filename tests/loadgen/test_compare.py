"""The comparison's ratios and verdicts, and the simulator hook: layouts from the bench
configs, predictions from a calibration file, relative errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.loadgen.compare import load_config, ratios
from orchestrator.loadgen.validate import compare_to_measured, layout_of, limits_of, predict
from orchestrator.sim.instances import EngineLimits
from orchestrator.sim.simulator import Layout
from orchestrator.sim.workload import LengthDist, Workload
from tests.sim.toy import affine

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _summary(itl_p99: float, speed: float, ttft_p50: float, tokens: float) -> dict[str, Any]:
    return {
        "itl_s": {"p99": itl_p99},
        "decode_tokens_per_s_per_request": {"mean": speed},
        "ttft_s": {"p50": ttft_p50, "p99": ttft_p50 * 2},
        "output_token_throughput": tokens,
        "goodput": None,  # nothing measured: reported as n/a, never a division by zero
    }


def test_ratios_and_verdicts() -> None:
    rows = {r["metric"]: r for r in ratios(_summary(0.1, 30, 2.0, 50), _summary(0.4, 20, 1.0, 60))}
    assert rows["ITL p99"]["ratio"] == pytest.approx(0.25)
    assert rows["ITL p99"]["verdict"] == "PASS"
    assert rows["decode tok/s per request (mean)"]["ratio"] == pytest.approx(1.5)
    assert rows["decode tok/s per request (mean)"]["verdict"] == "MISS"
    assert rows["TTFT p50"]["ratio"] == pytest.approx(2.0)
    assert rows["TTFT p50"]["verdict"] is None  # reported, no target
    assert rows["goodput"]["ratio"] is None


@pytest.mark.parametrize(
    ("disaggregated_file", "colocated_file", "split", "mixed"),
    [
        ("bench-disagg.yaml", "bench-colocated.yaml", (1, 1), 2),
        ("bench-disagg-2p1d.yaml", "bench-colocated-3m.yaml", (2, 1), 3),
        ("bench-disagg-2p1d-ngram.yaml", "bench-colocated-3m-ngram.yaml", (2, 1), 3),
    ],
)
def test_bench_configs_have_the_same_worker_processes(
    disaggregated_file: str, colocated_file: str, split: tuple[int, int], mixed: int
) -> None:
    disaggregated = load_config(CONFIGS / disaggregated_file, "/nonexistent/model")
    colocated = load_config(CONFIGS / colocated_file, "/nonexistent/model")
    assert str(disaggregated.model) == "/nonexistent/model"  # --model overrides the configs'
    assert layout_of(disaggregated) == Layout(num_prefill=split[0], num_decode=split[1])
    assert layout_of(colocated) == Layout(num_mixed=mixed)
    assert sum(g.replicas * g.tp for g in disaggregated.groups) == sum(
        g.replicas * g.tp for g in colocated.groups
    )
    assert colocated.group("mixed").limits.enable_chunked_prefill
    cost = affine()
    # 1024 pages of 16 tokens in every group (the calibration engine's own pool is not used).
    assert (
        limits_of(colocated, "mixed", cost)
        == limits_of(disaggregated, "decode", cost)
        == limits_of(disaggregated, "prefill", cost)
        == EngineLimits(32, 256, 16384)
    )


@pytest.mark.parametrize(
    ("speculating", "plain"),
    [
        ("bench-disagg-2p1d-ngram.yaml", "bench-disagg-2p1d.yaml"),
        ("bench-colocated-3m-ngram.yaml", "bench-colocated-3m.yaml"),
    ],
)
def test_the_speculating_bench_configs_differ_only_in_their_drafts(
    speculating: str, plain: str
) -> None:
    config = load_config(CONFIGS / speculating, "/nonexistent/model")
    drafting = [g for g in config.groups if g.speculative is not None]
    assert [g.role for g in drafting] == ["decode" if "disagg" in speculating else "mixed"]
    assert drafting[0].speculative.method == "ngram"  # type: ignore[union-attr]
    without = config.replace(groups=tuple(g.replace(speculative=None) for g in config.groups))
    assert without == load_config(CONFIGS / plain, "/nonexistent/model")


def test_the_paced_bench_config_differs_only_in_its_step_shapes() -> None:
    """The goodput config: whole prompts per prefill step, decode steps paced 30 ms apart."""
    config = load_config(CONFIGS / "bench-disagg-2p1d-paced.yaml", "/nonexistent/model")
    plain = load_config(CONFIGS / "bench-disagg-2p1d.yaml", "/nonexistent/model")
    assert config.engine_config("prefill").max_num_batched_tokens == 2048
    assert config.engine_config("decode").min_step_interval_s == 0.03
    assert limits_of(config, "decode", affine()).min_step_interval_s == 0.03
    unpaced = config.replace(
        groups=tuple(g.replace(limits=plain.group(g.role).limits) for g in config.groups)
    )
    assert unpaced == plain


def test_the_chat_pick_config_is_the_paced_one_with_one_prefill_worker_and_two_decoders() -> None:
    """The planner's pick for the chat mix on two shared cores, as a config to sweep."""
    config = load_config(CONFIGS / "bench-disagg-1p2d-paced.yaml", "/nonexistent/model")
    paced = load_config(CONFIGS / "bench-disagg-2p1d-paced.yaml", "/nonexistent/model")
    assert layout_of(config) == Layout(num_prefill=1, num_decode=2)
    swapped = config.replace(
        groups=tuple(g.replace(replicas=paced.group(g.role).replicas) for g in config.groups)
    )
    assert swapped == paced


def test_predictions_from_a_calibration_file(tmp_path: Path) -> None:
    # A hand-made calibration: prefill 1 ms + 0.1 ms/token, decode 10 ms + 1 ms/sequence.
    calibration = {
        "model": "small",
        "num_layers": 6,
        "kv_bytes_per_token": 12288,
        "kv_capacity_tokens": 16384,
        "prefill": [{"tokens": n, "context": 0, "seconds": 0.001 + 1e-4 * n} for n in (64, 256)]
        + [{"tokens": 128, "context": 0, "seconds": 0.001 + 1e-4 * 128}],
        "decode": [{"batch": b, "kv_tokens": 0, "seconds": 0.01 + 0.001 * b} for b in (1, 8, 32)],
    }
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(calibration))
    workload = Workload(4.0, 12, LengthDist.parse("fixed:256"), LengthDist.parse("fixed:16"))
    config = load_config(CONFIGS / "bench-colocated.yaml", tmp_path / "absent")
    prediction = predict(f"calibrated:{path}", config, workload.requests(), num_warmup=2)
    assert set(prediction) == {"ttft_p50_s", "itl_p99_s", "output_token_throughput"}
    # At least one full 256-token prefill step (a mixed step: + decode terms).
    assert prediction["ttft_p50_s"] >= 0.001 + 1e-4 * 256
    assert prediction["itl_p99_s"] >= 0.011

    measured = {
        "ttft_s": {"p50": prediction["ttft_p50_s"] * 2},
        "itl_s": {"p99": prediction["itl_p99_s"]},
        "output_token_throughput": prediction["output_token_throughput"] * 1.1,
    }
    rows = compare_to_measured(prediction, measured)
    assert rows["ttft_p50_s"]["error"] == pytest.approx(-0.5)
    assert not rows["ttft_p50_s"]["within_tolerance"]
    assert rows["itl_p99_s"]["error"] == pytest.approx(0.0)
    assert rows["output_token_throughput"]["within_tolerance"]


@pytest.mark.slow
def test_calibration_decode_points_at_long_contexts(tmp_path: Path) -> None:
    # The hook the validation needs: decode points whose KV reads reflect long prompts.
    from orchestrator.sim.calibrate import run_calibration

    data = run_calibration(
        tmp_path / "c.json",
        prefill_sizes=(16,),
        decode_batches=(1, 4),
        decode_contexts=(16, 160),
        repeats=1,
        budget=64,
    )
    kv = {(p["batch"], p["kv_tokens"] >= p["batch"] * 160) for p in data["decode"]}
    assert kv == {(1, False), (4, False), (1, True), (4, True)}
