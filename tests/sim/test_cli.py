"""``pdserve simulate`` / ``plan`` end to end on small inputs, and the input errors of all three
commands (TP sizes a model cannot run, SLOs and durations that are not positive finite
numbers, calibration points that cannot be measured) refused in one line before any work
(calibrate: parser only; its engine run takes tens of seconds)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from orchestrator.cli.main import build_parser, main
from orchestrator.config.cluster import ClusterConfig


def test_simulate_prints_one_line_per_layout(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--cost", "roofline:llama-3-70b:h100", "--layout", "1x4:1x4",
            "--layout", "2x4", "--rate", "2", "--num-requests", "40",
            "--prompt", "uniform:500-1500", "--output", "fixed:64"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "1P(tp4):1D(tp4)" in out and "2M(tp4)" in out and "tok/s/req" in out


def test_simulate_says_when_a_run_ends_before_the_cluster_fills_up(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Answers of 1024 tokens keep a request ~20 s in the cluster: 40 requests at 2 req/s leave
    # out its first 2 s of arrivals, 800 requests its first 40 s.
    argv = ["simulate", "--cost", "roofline:llama-3-70b:h100", "--layout", "1x4:1x4",
            "--rate", "2", "--prompt", "fixed:1000", "--output", "fixed:1024"]  # fmt: skip
    assert main([*argv, "--num-requests", "40"]) == 0
    err = capsys.readouterr().err
    assert "1P(tp4):1D(tp4): not steady state" in err and "raise --num-requests" in err
    assert main([*argv, "--num-requests", "800"]) == 0
    assert "not steady state" not in capsys.readouterr().err


def test_simulate_says_when_the_queue_grows_through_the_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # One decoder of 64 sequences, ~20 ms a step, 1024-token answers: ~3 req/s at most.
    argv = ["simulate", "--cost", "roofline:llama-3-70b:h100", "--layout", "1x4:1x4",
            "--prompt", "fixed:1000", "--output", "fixed:1024"]  # fmt: skip
    assert main([*argv, "--rate", "12", "--num-requests", "400"]) == 0
    err = capsys.readouterr().err
    assert "1P(tp4):1D(tp4): overloaded: the mean TTFT rose from" in err
    assert "lower --rate" in err and "not steady state" not in err
    assert main([*argv, "--rate", "2", "--num-requests", "800"]) == 0
    assert "overloaded" not in capsys.readouterr().err


def test_plan_prints_a_table_and_emits_a_loadable_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, helm = tmp_path / "cluster.yaml", tmp_path / "values.yaml"
    argv = ["plan", "--cost", "roofline:llama-3-70b:h100", "--gpus", "8", "--tp", "4,8",
            "--num-requests", "40", "--prompt", "fixed:1000", "--output", "fixed:32",
            "--min-duration", "2",
            "--emit-config", str(config), "--emit-helm", str(helm),
            "--model-path", str(tmp_path / "model")]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "goodput" in out and "best:" in out
    loaded = ClusterConfig.from_yaml(config)
    assert sum(group.num_ranks for group in loaded.groups) <= 8
    if loaded.is_disaggregated:
        assert yaml.safe_load(helm.read_text())["workerGroups"]["decode"]["gpuPerRank"] == 1


def test_plan_emits_the_rival_of_the_other_kind_and_the_sweep_that_checks_the_pick(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pick, rival = tmp_path / "pick.yaml", tmp_path / "rival.yaml"
    argv = ["plan", "--cost", "roofline:llama-3-70b:h100", "--gpus", "8", "--tp", "4,8",
            "--num-requests", "40", "--prompt", "fixed:1000", "--output", "fixed:32",
            "--min-duration", "2", "--model-path", str(tmp_path / "model")]  # fmt: skip
    # The sweep needs both configs: refused before the search, nothing written.
    assert main([*argv, "--emit-rival-config", str(rival)]) == 2
    assert "--emit-rival-config: give --emit-config too" in capsys.readouterr().err
    assert not rival.exists()
    assert main([*argv, "--emit-config", str(pick), "--emit-rival-config", str(rival)]) == 0
    out = capsys.readouterr().out
    picked, other = ClusterConfig.from_yaml(pick), ClusterConfig.from_yaml(rival)
    assert picked.is_disaggregated != other.is_disaggregated
    disaggregated, mixed = (pick, rival) if picked.is_disaggregated else (rival, pick)
    command = next(line for line in out.splitlines() if "pdserve bench sweep" in line).split()
    assert command[command.index("--disaggregated") + 1] == str(disaggregated)
    assert command[command.index("--colocated") + 1] == str(mixed)
    rates = [float(r) for r in command[command.index("--rates") + 1].split(",")]
    assert rates == sorted(rates) and len(rates) >= 2
    # Runs as long as the plan's simulations at the highest rate, and ten TTFT SLOs (the
    # default 2 s) at least, a tenth left out.
    requests = int(command[command.index("--num-requests") + 1])
    assert requests == math.ceil(rates[-1] * 20)
    assert int(command[command.index("--warmup") + 1]) == math.ceil(0.1 * requests)
    assert "goodput per GPU is the higher" in out and "rival: " in out


def test_emitted_configs_name_a_relative_model_path_from_their_own_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # --model-path is relative to the working directory; the loader reads a config file's
    # relative paths from the file's folder: the written files must still find the model.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plans").mkdir()
    argv = ["plan", "--cost", "roofline:llama-3-70b:h100", "--gpus", "8", "--tp", "4,8",
            "--num-requests", "40", "--prompt", "fixed:1000", "--output", "fixed:32",
            "--min-duration", "2", "--model-path", "models/small",
            "--emit-config", "plans/pick.yaml", "--emit-rival-config", "plans/rival.yaml"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    for name in ("pick.yaml", "rival.yaml"):
        written = tmp_path / "plans" / name
        assert yaml.safe_load(written.read_text())["model"] == "../models/small"
        model = Path(ClusterConfig.from_yaml(written).model)
        assert model.resolve() == (tmp_path / "models" / "small").resolve()
    # The printed config and the sweep's --model (a command line) keep the path as given.
    assert "model: models/small" in out and "--model models/small " in out


def test_calibrate_subcommand_exists() -> None:
    args = build_parser().parse_args(["calibrate", "--out", "x.json", "--fabric"])
    assert args.fabric and args.out == "x.json"
    assert args.concurrent == 1 and args.decode_context == "32,768"  # alone, long contexts


@pytest.mark.parametrize(
    "bad",
    [
        ["--concurrent", "0"],
        ["--decode-batch", "1,x"],
        ["--overheads-from", "/nonexistent.json"],
        ["--concurrent", "3", "--background", "1700"],
        ["--concurrent", "3", "--background", "0,48"],
        ["--concurrent", "3", "--background", "4000,200"],
    ],
)
def test_calibrate_refuses_bad_arguments_before_measuring(
    bad: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "c.json"
    assert main(["calibrate", "--out", str(out), *bad]) == 2
    assert "pdserve calibrate:" in capsys.readouterr().err
    assert not out.exists()


def test_calibrate_refuses_zero_repeats_before_measuring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import orchestrator.sim.calibrate

    def measure(*args: object, **kwargs: object) -> None:
        pytest.fail("measured with no timed run per point")

    monkeypatch.setattr(orchestrator.sim.calibrate, "run_calibration", measure)
    out = tmp_path / "c.json"
    assert main(["calibrate", "--out", str(out), "--repeats", "0"]) == 2
    assert "pdserve calibrate: repeats must be >= 1" in capsys.readouterr().err
    assert not out.exists()


LLAMA_H200 = "roofline:llama-3-70b:h200"
SIMULATE = ["simulate", "--cost", "roofline:llama-3-70b:h100", "--layout", "1x4:1x4",
            "--num-requests", "10", "--prompt", "fixed:500", "--output", "fixed:8"]  # fmt: skip
PLAN = ["plan", "--cost", "roofline:llama-3-70b:h100", "--gpus", "8", "--tp", "4",
        "--num-requests", "10", "--prompt", "fixed:500", "--output", "fixed:8",
        "--min-duration", "1"]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([*SIMULATE, "--cost", "roofline:foo:h200"], "unknown preset 'foo'"),
        ([*SIMULATE, "--cost", "roofline:llama-3-70b:h100:mfu=2"], "mfu must be in (0, 1]"),
        ([*SIMULATE, "--cost", "roofline:llama-3-70b:h100:speed=2"], "unknown roofline setting"),
        ([*SIMULATE, "--cost", "calibrated:/nonexistent.json"], "/nonexistent.json"),
        ([*SIMULATE, "--layout", "1x8:abc"], "bad layout '1x8:abc'"),
        ([*SIMULATE, "--layout", "1x4:2x4:ep2"], "has no routed experts to spread"),
        ([*SIMULATE, "--layout", "1x4:3x4:ep2"], "must divide the decode group"),
        ([*SIMULATE, "--prompt", "foo:3"], "bad length distribution"),
        ([*SIMULATE, "--rate", "0"], "rate must be a positive number"),
        ([*SIMULATE, "--warmup", "0.6"], "warmup must be in [0, 0.5)"),
        ([*SIMULATE, "--prompt", "fixed:10000000"], "KV tokens"),  # UnservableError
        ([*PLAN, "--gpus", "0"], "gpu_budget must be >= 1"),
        ([*PLAN, "--attainment", "2"], "attainment must be in (0, 1]"),
        ([*PLAN, "--tp", "4,x"], "--tp wants comma-separated TP sizes"),
        ([*PLAN, "--warmup", "0.6"], "warmup must be in [0, 0.5)"),
        ([*PLAN, "--min-step-interval-ms", "0,x"], "--min-step-interval-ms wants a number"),
        ([*PLAN, "--max-num-batched-tokens", "256,256"], "lists a value twice"),
        ([*PLAN, "--min-step-interval-ms", "0,-5"], "min_step_interval_s must be >= 0"),
        ([*SIMULATE, "--min-step-interval-ms", "0,30"], "take one value here"),
    ],
)
def test_input_errors_exit_2_with_a_message_not_a_traceback(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pdserve {argv[0]}: ") and message in err


def test_a_calibration_of_another_shape_is_an_input_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.json"
    for text in ("not json", '{"num_layers": 4}'):
        path.write_text(text)
        assert main([*SIMULATE, "--cost", f"calibrated:{path}"]) == 2
        assert f"pdserve simulate: {path}: not" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-num-batched-tokens", "1000"], "must be a multiple of page_size (16)"),
        (["--max-num-batched-tokens", "2048,1000"], "must be a multiple of page_size (16)"),
        (["--provider", "tcp;ofi_rxm"], "cannot register GPU memory"),
    ],
)
def test_plan_refuses_what_no_emitted_config_could_carry_before_searching(
    flags: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import orchestrator.sim.planner

    def search(*args: object) -> None:
        pytest.fail("searched layouts for a config the loader refuses")

    monkeypatch.setattr(orchestrator.sim.planner, "plan", search)
    config = tmp_path / "cluster.yaml"
    assert main([*PLAN, *flags, "--emit-config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve plan: ") and message in err
    assert not config.exists()


def test_plan_writes_nothing_the_loader_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import orchestrator.sim.emit
    from orchestrator.config.cluster import ConfigError

    def refused(*args: object, **kwargs: object) -> None:
        raise ConfigError("groups", "refused by the loader")

    # Whatever the search picked, the config is loaded before it is printed or written.
    monkeypatch.setattr(orchestrator.sim.emit.ClusterConfig, "from_dict", refused)
    monkeypatch.setattr(orchestrator.sim.emit, "check_options", lambda *a, **k: None)
    config, helm = tmp_path / "cluster.yaml", tmp_path / "values.yaml"
    argv = [*PLAN, "--emit-config", str(config), "--emit-helm", str(helm)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve plan: the cluster config of ") and "refused by the" in err
    assert not config.exists() and not helm.exists()


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


@pytest.mark.parametrize("bound", ["0", "nan"])
def test_simulate_refuses_a_stall_bound_that_is_not_positive(
    bound: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*SIMULATE, "--max-itl-slo", bound]) == 2
    assert capsys.readouterr().err.startswith("pdserve simulate: SLOs must be positive")


@pytest.mark.parametrize("duration", ["inf", "nan"])
def test_plan_refuses_a_min_duration_that_is_not_finite(
    duration: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*PLAN, "--min-duration", duration]) == 2
    assert "min_duration_s must be finite" in capsys.readouterr().err


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
