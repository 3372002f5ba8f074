"""``pdserve simulate`` / ``plan`` end to end on small inputs (calibrate: parser only; its
engine run takes tens of seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from orchestrator.cli import build_parser, main
from orchestrator.config import ClusterConfig


def test_simulate_prints_one_line_per_layout(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--cost", "roofline:llama-3-70b:h100", "--layout", "1x4:1x4",
            "--layout", "2x4", "--rate", "2", "--num-requests", "40",
            "--prompt", "uniform:500-1500", "--output", "fixed:64"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "1P(tp4):1D(tp4)" in out and "2M(tp4)" in out and "tok/s/req" in out


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
