"""Fixed per-request costs from a saved compare result: which requests count as alone, and
the residual against the simulator recovering a known overhead."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.cli.main import main
from orchestrator.loadgen.compare import load_config
from orchestrator.loadgen.overheads import (
    FIT_NOISE_SEEDS,
    derive,
    isolated,
    residuals,
    token_delay,
)
from orchestrator.loadgen.validate import predict, simulator_for
from orchestrator.sim.workload import LengthDist, RequestSpec, Workload
from tests.sim.toy import affine

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _request(index: int, sent: float, ttft: float, e2e: float, **extra: Any) -> dict[str, Any]:
    record = {"index": index, "sent_s": sent, "ttft_s": ttft, "e2e_s": e2e, "error": None,
              "prompt_tokens": 600, "output_tokens": 8}  # fmt: skip
    record.update(extra)
    return record


def test_a_request_is_alone_when_nothing_else_is_in_flight_before_its_first_token() -> None:
    requests = [
        _request(0, 0.0, 0.5, 2.0),  # alone: the next one is sent after it finished
        _request(1, 3.0, 0.5, 2.0),  # not alone: 2 is sent before 1's first token
        _request(2, 3.2, 0.5, 2.0),  # not alone: 1 is in flight when 2 is sent
        _request(3, 6.0, 0.5, 2.0),  # alone: 4 arrives after its first token (decode overlap)
        _request(4, 6.8, 0.5, 2.0),  # not alone: 3 is still decoding
        _request(5, 20.0, None, None, error="UNAVAILABLE"),  # errored: never a sample
        _request(6, 21.0, 0.5, 2.0),  # not alone: 5 counts as in flight to the end of the run
    ]
    assert [r["index"] for r in isolated(requests)] == [0, 3]


def test_residuals_recover_a_known_overhead_against_the_same_model() -> None:
    cost = affine(capacity=16384)
    config = load_config(CONFIGS / "bench-disagg.yaml", "/nonexistent/model")
    requests = []
    for i, (prompt, fixed) in enumerate([(512, 0.08), (700, 0.1), (1000, 0.12)]):
        spec = RequestSpec(0, 0.0, prompt, 8)
        alone = simulator_for(cost, config).run([spec]).records[0].ttft
        requests.append(
            _request(i, 10.0 * i, alone + fixed, alone + fixed + 1, prompt_tokens=prompt)
        )
    found = residuals(cost, config, requests)
    assert found.kind == "disaggregated"
    assert found.seconds == pytest.approx((0.08, 0.1, 0.12))
    assert found.overhead == pytest.approx(0.1)  # the median
    # A model slower than the run gives negative residuals: no overhead, never a negative one.
    slow = affine(capacity=16384, prefill=(0.5, 1e-3, 0.0))
    assert residuals(slow, config, requests).overhead == 0.0


def _document(tmp_path: Path, ttft_p50: float = 0.4, name: str = "compare.json") -> Path:
    requests = [_request(i, 10.0 * i, 0.4, 1.0) for i in range(3)]
    summary = {"ttft_s": {"p50": ttft_p50}, "itl_s": {"p99": 0.02}, "output_token_throughput": 8.0}
    document = {
        "command": "compare",
        "workload": {"rate": 0.1, "arrival": "poisson", "num_requests": 3, "duration": None,
                     "prompt": "fixed:600", "output": "fixed:8", "seed": 0, "warmup": 1},
        "configs": {"disaggregated": str(CONFIGS / "bench-disagg.yaml"),
                    "colocated": str(CONFIGS / "bench-colocated.yaml")},
        "runs": [{"name": n, "summary": summary, "requests": requests}
                 for n in ("disaggregated", "colocated")],
    }  # fmt: skip
    path = tmp_path / name
    path.write_text(json.dumps(document))
    return path


def test_derive_writes_both_kinds_and_refuses_what_it_cannot_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    document = json.loads(_document(tmp_path).read_text())
    entry = derive(affine(capacity=16384), document, "compare.json")
    assert entry["from"] == "compare.json"
    assert entry["disaggregated_requests"] == entry["mixed_requests"] == 3
    assert entry["disaggregated_s"] > 0 and entry["mixed_s"] > 0
    # One decode step per gap and a measured ITL p99 far above it: a delay fills the rest.
    assert 0 < entry["disaggregated_token_s"] <= 0.02 and 0 < entry["mixed_token_s"] <= 0.02
    with pytest.raises(ValueError, match="not a pdserve bench compare"):
        derive(affine(), {"command": "run"}, "run.json")
    assert "share cached prefixes" not in capsys.readouterr().err
    # A run whose prompts share a prefix: derived, with a warning that the cost is unreliable.
    document["workload"]["prefix_hit"] = 0.5
    derive(affine(capacity=16384), document, "compare.json")
    assert "compare.json: its prompts share cached prefixes" in capsys.readouterr().err
    with pytest.raises(ValueError, match="without overheads"):
        derive(affine(overhead=(0.1, 0.0)), document, "compare.json")


def test_the_token_delay_is_the_one_that_gives_the_measured_itl_p99() -> None:
    cost = affine(capacity=16384)
    config = load_config(CONFIGS / "bench-disagg.yaml", "/nonexistent/model")
    workload = Workload(2.0, 40, LengthDist.parse("fixed:300"), LengthDist.parse("fixed:32"))
    specs = workload.requests()
    truth = dataclasses.replace(cost, token_delay_s=(0.002, 0.002))
    measured = predict(truth, config, specs, 4, FIT_NOISE_SEEDS)["itl_p99_s"]
    assert token_delay(cost, config, specs, 4, measured) == pytest.approx(0.002, rel=0.02)
    # Steps that already reach the measured tail leave nothing to the way out.
    steps_only = predict(cost, config, specs, 4, FIT_NOISE_SEEDS)["itl_p99_s"]
    assert token_delay(cost, config, specs, 4, 0.9 * steps_only) == 0.0
    assert token_delay(cost, config, specs, 4, 0.0) == 0.0  # a run without a figure


def _calibration(tmp_path: Path) -> tuple[dict[str, Any], Path]:
    calibration = {
        "num_layers": 6, "kv_bytes_per_token": 12288, "kv_capacity_tokens": 16384,
        "prefill": [{"tokens": n, "context": 0, "seconds": 0.001 + 1e-4 * n} for n in (64, 128, 256)],
        "decode": [{"batch": b, "kv_tokens": 0, "seconds": 0.01 + 0.001 * b} for b in (1, 8, 32)],
        "overheads": {"from": "x", "disaggregated_s": 0.05, "mixed_s": 0.04},
    }  # fmt: skip
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(calibration))
    return calibration, path


def test_validate_takes_overheads_from_a_result_or_leaves_them_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = _document(tmp_path)
    calibration, path = _calibration(tmp_path)
    base = ["bench", "validate", str(result), "--calibration", str(path)]
    assert main(base) == 0
    assert "disaggregated 0.050 s, mixed 0.040 s" in capsys.readouterr().out
    assert main([*base, "--no-overheads"]) == 0
    assert "disaggregated 0.000 s, mixed 0.000 s" in capsys.readouterr().out
    assert main([*base, "--overheads-from", str(result)]) == 0
    derived = capsys.readouterr().out
    assert "disaggregated 0.050 s" not in derived and "ttft_p50_s" in derived
    # Residuals against a much slower model: none left over, so no overhead.
    slow = dict(
        calibration, prefill=[dict(p, seconds=p["seconds"] + 5) for p in calibration["prefill"]]
    )
    (tmp_path / "slow.json").write_text(json.dumps(slow))
    against = ["--overheads-from", str(result), "--overheads-against", str(tmp_path / "slow.json")]
    assert main([*base, *against]) == 0
    assert "disaggregated 0.000 s, mixed 0.000 s" in capsys.readouterr().out


def test_validate_checks_repeats_of_one_compare_against_their_median(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, calibration = _calibration(tmp_path)
    runs = [_document(tmp_path, p50, f"run{i}.json") for i, p50 in enumerate((0.3, 0.9, 0.5))]
    written = tmp_path / "validation.json"
    argv = ["bench", "validate", *map(str, runs), "--calibration", str(calibration)]
    assert main([*argv, "--json", str(written)]) == 0
    out = capsys.readouterr().out
    for name in ("disaggregated", "colocated"):
        assert all(f"({name}, run{i}.json)" in out for i in range(3))
        median = out.split(f"({name}, median of 3 runs):")[1].splitlines()[1]
        assert "ttft_p50_s" in median and "measured     0.5000" in median
    # The summary counts the median's figures, as does the file.
    document = json.loads(written.read_text())
    medians = [block.splitlines()[1:4] for block in out.split("median of 3 runs):")[1:]]
    within = sum(line.endswith(" ok") for lines in medians for line in lines)
    assert (document["within_tolerance"], document["figures"]) == (within, 6)
    assert f"within 15%: {within} of 6 figures, against the median of the results" in out
    checks = document["configs"]["colocated"]
    assert checks["median"]["ttft_p50_s"]["measured"] == 0.5
    assert [checks["results"][str(run)]["ttft_p50_s"]["measured"] for run in runs] == [
        0.3,
        0.9,
        0.5,
    ]
    # Another workload (or other configs) is not a repeat: refused.
    other = json.loads(runs[0].read_text())
    other["workload"]["seed"] = 1
    (tmp_path / "other.json").write_text(json.dumps(other))
    args = [str(runs[0]), str(tmp_path / "other.json"), "--calibration", str(calibration)]
    assert main(["bench", "validate", *args]) == 2
    assert "only repeats of one compare" in capsys.readouterr().err
