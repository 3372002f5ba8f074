"""`bench validate` and `compare --simulate` against the served config: each group's limits and
KV pool in the simulator, the calibration checked before the clusters run, the measured result
written whatever the simulation does, and input errors reported, not raised."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import orchestrator.loadgen.compare as compare
import orchestrator.loadgen.validate as validate
from orchestrator.cli.main import main
from orchestrator.config.cluster import ClusterConfig
from orchestrator.loadgen.compare import load_config
from orchestrator.loadgen.records import RequestResult
from orchestrator.loadgen.requests import document_specs
from orchestrator.loadgen.runner import RunOutcome
from orchestrator.loadgen.session import BenchOptions
from orchestrator.loadgen.stats import summarize
from orchestrator.loadgen.validate import limits_of, predict
from orchestrator.sim.instances import EngineLimits
from orchestrator.sim.workload import LengthDist, Workload
from tests.sim.toy import affine

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _with_limits(config: ClusterConfig, role: str | None, **changes: Any) -> ClusterConfig:
    """``config`` with ``changes`` to one group's limits (every group's when ``role`` is None)."""
    groups = tuple(
        g.replace(limits=g.limits.replace(**changes)) if role in (None, g.role) else g
        for g in config.groups
    )
    return config.replace(groups=groups)


def test_the_served_kv_pool_not_the_calibrations_bounds_the_prediction() -> None:
    cost = affine(capacity=32320)  # the calibration engine's own pool, per rank
    config = load_config(CONFIGS / "bench-disagg.yaml", "/nonexistent/model")
    specs = Workload(
        20.0, 80, LengthDist.parse("fixed:768"), LengthDist.parse("fixed:256")
    ).requests()
    roomy = predict(cost, _with_limits(config, None, num_pages=1024), specs, 0)
    small = predict(cost, _with_limits(config, None, num_pages=128), specs, 0)
    # 2048 tokens hold two 1024-token requests where 16384 hold sixteen (max_num_seqs 32).
    assert small["output_token_throughput"] < 0.5 * roomy["output_token_throughput"]
    assert small["ttft_p50_s"] > roomy["ttft_p50_s"]


def test_each_group_brings_its_own_limits_and_pool() -> None:
    config = load_config(CONFIGS / "bench-disagg.yaml", "/nonexistent/model")
    config = _with_limits(config, "prefill", max_num_batched_tokens=1024, num_pages=512)
    cost = affine()
    assert limits_of(config, "prefill", cost) == EngineLimits(32, 1024, 512 * 16)
    assert limits_of(config, "decode", cost) == EngineLimits(32, 256, 1024 * 16)
    simulator = validate.simulator_for(cost, config)
    assert [p.limits.max_num_batched_tokens for p in simulator.prefills] == [1024]
    assert [d.limits.max_num_batched_tokens for d in simulator.decodes] == [256]
    assert (simulator.prefills[0].capacity, simulator.decodes[0].capacity) == (8192, 16384)
    # kv_memory_bytes per rank, at the cost model's 1024 bytes per token: 16 KiB pages.
    by_bytes = _with_limits(config, "decode", num_pages=None, kv_memory_bytes=16 << 20)
    assert limits_of(by_bytes, "decode", cost).kv_capacity_tokens == 1024 * 16


def _busy_trace(role: str, shape: list[int]) -> dict[str, Any]:
    """40 back-to-back steps of one shape, alternately fast and slow."""
    records, start = [], 0.0
    for i in range(40):
        seconds = 0.01 if i % 2 else 0.03
        records.append([start, seconds, float(i == 0), *shape])
        start += seconds
    return {"worker_id": f"{role}-0", "role": role, "num_recorded": 40, "records": records}


TRACED_SHAPES = {"prefill": [64, 2080, 0, 0], "decode": [0, 0, 1, 70], "mixed": [0, 0, 1, 70]}


class _FakeClusters:
    """`run_cluster` without Ray: one finished request per cluster; ``traced``: its workers
    report step traces of noisy steps, else an empty one."""

    def __init__(self, traced: bool = False) -> None:
        self.names: list[str] = []
        self.traced = traced

    async def __call__(
        self, name: str, config: ClusterConfig, options: BenchOptions, num_cpus: int | None = None
    ) -> compare.ClusterRun:
        self.names.append(name)
        chunks = [(0.1, 1), (0.2, 1), (0.3, 1), (0.4, 1)]
        result = RequestResult(0, False, 0.0, 10, 4, sent_s=0.0, chunks=chunks, finish_s=0.4)
        outcome = RunOutcome("grpc", [result], 0, 8, 1.0)
        traces = [{"worker_id": f"{name}-0", "role": "mixed", "num_recorded": 0, "records": []}]
        if self.traced:
            roles = ("prefill", "decode") if name == "disaggregated" else ("mixed",)
            traces = [_busy_trace(role, TRACED_SHAPES[role]) for role in roles]
        return compare.ClusterRun(
            name, config, outcome, summarize([result], options.slos), "", "", traces
        )


def _compare_argv(tmp_path: Path, calibration: Path) -> list[str]:
    return ["bench", "compare", "--disaggregated", str(CONFIGS / "bench-disagg.yaml"),
            "--colocated", str(CONFIGS / "bench-colocated.yaml"), "--model", str(tmp_path / "m"),
            "--num-requests", "2", "--prompt", "fixed:64", "--output", "fixed:4",
            "--simulate", str(calibration), "--json", str(tmp_path / "out.json")]  # fmt: skip


def _calibration(tmp_path: Path) -> Path:
    path = tmp_path / "calibration.json"
    path.write_text(
        json.dumps(
            {
                "num_layers": 4,
                "kv_bytes_per_token": 1024,
                "kv_capacity_tokens": 1 << 20,
                "prefill": [
                    {"tokens": t, "context": 0, "seconds": 1e-3 + 1e-4 * t} for t in (64, 128, 256)
                ],
                "decode": [
                    {"batch": b, "kv_tokens": 100 * b, "seconds": 1e-3 + 1e-5 * b}
                    for b in (1, 8, 32)
                ],
            }
        )
    )
    return path


@pytest.mark.parametrize("calibration", ["absent.json", "bad.json"])
def test_compare_checks_the_calibration_before_running_the_clusters(
    calibration: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clusters = _FakeClusters()
    monkeypatch.setattr(compare, "run_cluster", clusters)
    (tmp_path / "bad.json").write_text('{"prefill": []}')
    assert main(_compare_argv(tmp_path, tmp_path / calibration)) == 2
    assert capsys.readouterr().err.startswith("pdserve bench compare: ")
    assert clusters.names == []  # no benchmark spent on a run that could not be validated


def test_compare_writes_the_measured_result_before_simulating_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compare, "run_cluster", _FakeClusters())

    def unservable(*args: object, **kwargs: object) -> None:
        raise ValueError("a request the simulated pool cannot hold")

    monkeypatch.setattr(validate, "predict", unservable)
    assert main(_compare_argv(tmp_path, _calibration(tmp_path))) == 2
    assert "--simulate: a request the simulated pool" in capsys.readouterr().err
    document = json.loads((tmp_path / "out.json").read_text())
    assert [run["name"] for run in document["runs"]] == ["disaggregated", "colocated"]
    # With the workers' step traces, for `pdserve calibrate --from-trace`.
    assert [run["step_traces"][0]["worker_id"] for run in document["runs"]] == [
        "disaggregated-0",
        "colocated-0",
    ]
    assert document["simulation"] is None


def test_compare_records_the_simulation_when_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compare, "run_cluster", _FakeClusters())
    assert main(_compare_argv(tmp_path, _calibration(tmp_path))) == 0
    document = json.loads((tmp_path / "out.json").read_text())
    assert set(document["simulation"]) == {"disaggregated", "colocated", "calibration"}


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (ValueError("prompt longer than the served model's max_model_len"), "max_model_len"),
        ("rpc", "UNAVAILABLE: no router"),
    ],
)
def test_compare_reports_a_failed_measurement(
    error: Any,
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import grpc

    if error == "rpc":
        error = grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "no router"
        )

    async def failing(*args: object) -> None:
        raise error

    monkeypatch.setattr(compare, "run_cluster", failing)
    assert main(_compare_argv(tmp_path, _calibration(tmp_path))) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve bench compare: ") and message in err


def test_validate_with_a_calibration_from_the_results_own_traces(
    tmp_path: Path,
    tiny_model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(compare, "run_cluster", _FakeClusters(traced=True))
    argv = _compare_argv(tmp_path, _calibration(tmp_path))
    argv[argv.index("--model") + 1] = str(tiny_model_dir)  # the trace's facts come from it
    assert main(argv) == 0
    result, traced = tmp_path / "out.json", tmp_path / "traced.json"
    assert main(["calibrate", "--from-trace", str(result), "--out", str(traced)]) == 0
    assert json.loads(traced.read_text())["num_layers"] == 4  # the tiny preset: --model's
    capsys.readouterr()

    def validate(seed: int) -> str:
        command = ["bench", "validate", str(result), "--calibration", str(traced)]
        assert main([*command, "--noise-seed", str(seed)]) == 0
        return capsys.readouterr().out

    # One request: its 3 decode steps are 3 draws of the noise (fast or slow, as traced).
    assert validate(1) == validate(1)
    assert len({validate(seed) for seed in range(6)}) > 1
    command = ["bench", "validate", str(result), "--calibration", str(traced)]
    assert main([*command, "--noise-repeats", "5"]) == 0
    assert "seeds 0..4, each figure the median of 5 simulations" in capsys.readouterr().out
    assert main([*command, "--noise-repeats", "0"]) == 2
    assert "--noise-repeats must be >= 1" in capsys.readouterr().err


def test_validate_reports_input_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    calibration = _calibration(tmp_path)
    assert main(["bench", "validate", "/nonexistent.json", "--calibration", str(calibration)]) == 2
    assert "pdserve bench validate: " in capsys.readouterr().err
    result = tmp_path / "result.json"
    result.write_text("{not json")
    assert main(["bench", "validate", str(result), "--calibration", str(calibration)]) == 2
    assert "pdserve bench validate: " in capsys.readouterr().err
    result.write_text(json.dumps({"command": "compare", "workload": {}, "configs": {}}))
    missing = tmp_path / "absent.json"
    assert main(["bench", "validate", str(result), "--calibration", str(missing)]) == 2
    assert f"pdserve bench validate: [Errno 2] No such file or directory: '{missing}'" in (
        capsys.readouterr().err
    )


def test_compare_refuses_a_warmup_that_leaves_nothing_measured_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    clusters = _FakeClusters()
    monkeypatch.setattr(compare, "run_cluster", clusters)
    # The first arrival is at 0: a 1 ms run keeps it alone, and one warm-up leaves none.
    argv = [*_compare_argv(tmp_path, _calibration(tmp_path)), "--duration", "0.001"]
    assert main([*argv, "--warmup", "1"]) == 2
    assert "pdserve bench compare: warm-up must be in [0, 1)" in capsys.readouterr().err
    assert clusters.names == []


def test_compare_refuses_a_prefix_share_outside_0_to_1_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    clusters = _FakeClusters()
    monkeypatch.setattr(compare, "run_cluster", clusters)
    argv = _compare_argv(tmp_path, _calibration(tmp_path))
    for share in ("1.5", "-0.1", "nan"):
        assert main([*argv, "--prefix-hit", share]) == 2
        assert "--prefix-hit: a share of each prompt, in [0, 1]" in capsys.readouterr().err
    assert clusters.names == []


def test_validate_refuses_a_saved_run_that_measured_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workload = {"rate": 1.0, "arrival": "poisson", "num_requests": 2, "duration": 0.001,
                "prompt": "fixed:64", "output": "fixed:4", "seed": 0, "warmup": 1}  # fmt: skip
    result = tmp_path / "result.json"
    result.write_text(
        json.dumps({"command": "compare", "workload": workload, "configs": {}, "runs": []})
    )
    calibration = _calibration(tmp_path)
    assert main(["bench", "validate", str(result), "--calibration", str(calibration)]) == 2
    assert "pdserve bench validate: warm-up must be in [0, 1)" in capsys.readouterr().err


def _speculating(config: ClusterConfig, role: str, k: int = 2) -> ClusterConfig:
    from orchestrator.config.sections import SpeculativeSection

    spec = SpeculativeSection(method="ngram", num_speculative_tokens=k)
    groups = tuple(g.replace(speculative=spec) if g.role == role else g for g in config.groups)
    return config.replace(groups=groups)


def _spec_trace(role: str, drafts: int, kept: list[int], k: int = 2) -> dict[str, Any]:
    counters = {"method": "ngram", "num_speculative_tokens": k, "num_draft_tokens": drafts,
                "num_accepted_tokens_per_pos": kept}  # fmt: skip
    return {"worker_id": f"{role}-0", "role": role, "records": [], "speculative": counters}


def test_the_runs_acceptance_comes_from_its_decoders_draft_counters() -> None:
    # Two decoders: 60 verifications of 2 drafts, 45 first drafts kept, 15 second ones.
    traces = [
        {"worker_id": "prefill-0", "role": "prefill", "records": []},
        _spec_trace("decode", 80, [30, 10]),
        _spec_trace("decode", 40, [15, 5]),
    ]
    assert validate.acceptance_of(traces) == pytest.approx((0.75, 1 / 3))
    assert validate.acceptance_of(traces[:1]) is None  # nothing speculated


def test_the_simulated_cluster_speculates_and_caches_as_the_config_says() -> None:
    config = load_config(CONFIGS / "bench-disagg.yaml", "/nonexistent/model")
    plain = validate.serving_options(config)
    assert plain.speculative is None and plain.prefix_caching
    assert plain.routing == "least_outstanding"
    speculating = _speculating(config, "decode")
    with pytest.raises(ValueError, match="the run's acceptance is needed"):
        validate.serving_options(speculating)
    with pytest.raises(ValueError, match="1 draft positions, not 2"):
        validate.serving_options(speculating, (0.5,))
    options = validate.serving_options(speculating, (0.75, 0.5, 0.1))
    assert options.speculative is not None
    assert (options.speculative.method, options.speculative.acceptance) == ("ngram", (0.75, 0.5))
    uncached = _with_limits(config, None, enable_prefix_caching=False)
    assert not validate.serving_options(uncached).prefix_caching

    # Drafts that are always kept emit three tokens a step: a saturated cluster puts out more.
    cost = affine()
    workload = Workload(50.0, 40, LengthDist.parse("fixed:128"), LengthDist.parse("fixed:64"))
    kept = predict(cost, speculating, workload.requests(), 0, acceptance=(1.0, 1.0))
    rejected = predict(cost, speculating, workload.requests(), 0, acceptance=(0.0, 0.0))
    assert kept["output_token_throughput"] > 1.5 * rejected["output_token_throughput"]


def test_a_saved_runs_common_prefix_is_simulated_as_cached() -> None:
    saved = {"rate": 2.0, "arrival": "poisson", "num_requests": 20, "duration": None,
             "prompt": "fixed:512", "output": "fixed:16", "seed": 0, "warmup": 4}  # fmt: skip
    before, warmup = document_specs({"workload": saved})  # saved before --prefix-hit
    assert warmup == 4 and all(s.num_common_tokens == 0 for s in before)
    specs, _ = document_specs({"workload": {**saved, "prefix_hit": 0.5}})
    assert [s.num_common_tokens for s in specs] == [256] * 20
    assert [s.arrival_time for s in specs] == [s.arrival_time for s in before]
    # Prefill on the uncached half only: the first tokens come sooner.
    config = load_config(CONFIGS / "bench-disagg.yaml", "/nonexistent/model")
    cost = affine(capacity=16384, prefill=(0.002, 1e-3, 0.0))
    cached = predict(cost, config, specs, 4)["ttft_p50_s"]
    assert cached < 0.75 * predict(cost, config, before, 4)["ttft_p50_s"]
