"""``pdserve simulate / plan`` with speculative decoding, prefix caching, multi-turn
workloads and routing: they run, and bad values are refused in one line naming the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from orchestrator.cli.main import main
from orchestrator.config.cluster import ClusterConfig

R1 = ["--cost", "roofline:deepseek-r1:h200:8x400g", "--layout", "1x8:1x8", "--layout", "2x8"]
SMALL = ["--num-requests", "20", "--prompt", "fixed:2048", "--output", "fixed:64"]
LLAMA_PLAN = ["plan", "--cost", "roofline:llama-3-70b:h100", "--gpus", "8", "--tp", "4",
              "--num-requests", "30", "--min-duration", "2"]  # fmt: skip


def test_simulate_with_mtp_drafts_prints_the_options_and_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["simulate", *R1, *SMALL, "--spec-k", "1", "--spec-acceptance", "0.87"]) == 0
    out = capsys.readouterr().out
    assert "serving: mtp k=1, acceptance 0.87" in out and "2M(tp8)" in out


def test_simulate_takes_a_profile_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"acceptance": [0.9, 0.7, 0.5]}))
    argv = ["simulate", *R1, *SMALL, "--spec-k", "2", "--spec-profile", str(profile)]
    assert main(argv) == 0
    assert "k=2, acceptance 0.9,0.7" in capsys.readouterr().out


def test_simulate_multiturn_reports_what_caching_saved(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["simulate", "--cost", "roofline:llama-3-70b:h100", "--layout", "1x4:1x4",
            "--prompt", "multiturn:4:3", "--output", "fixed:32", "--system-tokens", "512",
            "--question-tokens", "16-32", "--routing", "kv_aware"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "4 conversations x 3 turns" in out and "routing kv_aware" in out
    assert "prompt tokens computed" in out and "KV pushed" in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--spec-acceptance", "1.2"], "--spec-acceptance: acceptance at draft position 0"),
        (["--spec-acceptance", "0.9,-0.1"], "must be in [0, 1]"),
        (["--spec-acceptance", "0.9,x"], "--spec-acceptance: comma-separated"),
        (["--spec-k", "0", "--spec-acceptance", "0.9"], "--spec-k: drafts per step must be >= 1"),
        (["--spec-k", "2", "--spec-acceptance", "0.9"], "give one per draft position"),
        (["--spec-k", "1"], "--spec-k: give the acceptance"),
        (["--spec-profile", "/nonexistent/profile.json"], "--spec-profile: no such"),
        (["--spec-acceptance", "0.9", "--spec-profile", "p.json"], "give one of them"),
        (["--prefix-hit", "1.5"], "--prefix-hit"),
        (["--system-tokens", "64"], "--system-tokens: only with --prompt multiturn"),
        (["--prompt", "multiturn:4"], "multiturn:CONVERSATIONS:TURNS"),
        (["--prompt", "multiturn:4:2", "--num-requests", "9"], "--num-requests"),
        (["--prompt", "multiturn:4:2", "--question-tokens", "a-b"], "--question-tokens"),
    ],
)
def test_bad_options_are_refused_in_one_line(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["simulate", *R1, "--prompt", "fixed:2048", "--output", "fixed:64"]
    assert main([*base, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve simulate: ") and message in err and err.count("\n") == 1


def test_mtp_drafts_on_a_model_without_the_module_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["simulate", "--cost", "roofline:llama-3-70b:h100", "--layout", "2x4", *SMALL,
            "--spec-k", "1", "--spec-acceptance", "0.8"]  # fmt: skip
    assert main(argv) == 2
    assert "no MTP module" in capsys.readouterr().err
    assert main([*argv, "--spec-method", "ngram"]) == 0


def test_plan_emits_the_drafts_routing_and_pacing_it_assumed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "cluster.yaml"
    argv = [*LLAMA_PLAN, "--prompt", "fixed:1000", "--output", "fixed:32",
            "--spec-k", "2", "--spec-acceptance", "0.8,0.6",
            "--spec-method", "ngram", "--routing", "kv_aware", "--min-step-interval-ms", "20",
            "--emit-config", str(config), "--model-path", str(tmp_path / "model")]  # fmt: skip
    assert main(argv) == 0
    assert "serving: ngram k=2" in capsys.readouterr().out
    emitted = yaml.safe_load(config.read_text())
    assert emitted["router"]["policy"] == "kv_aware"
    drafting = emitted["groups"].get("decode") or emitted["groups"]["mixed"]
    assert drafting["speculative"] == {"method": "ngram", "num_speculative_tokens": 2}
    # Pacing on the group that decodes; a prefill group's steps are never paced.
    assert drafting["limits"]["min_step_interval_ms"] == 20
    assert "min_step_interval_ms" not in emitted["limits"]
    assert "min_step_interval_ms" not in emitted["groups"].get("prefill", {}).get("limits", {})
    ClusterConfig.from_yaml(config)  # the loader accepts it


def test_plan_searches_listed_step_settings_and_emits_the_best_layouts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "cluster.yaml"
    argv = [*LLAMA_PLAN, "--prompt", "fixed:3000", "--output", "fixed:32",
            "--max-num-batched-tokens", "1024,4096",
            "--min-step-interval-ms", "0,20", "--emit-config", str(config),
            "--model-path", str(tmp_path / "model")]  # fmt: skip
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    top = next(i for i, line in enumerate(lines) if line.lstrip().startswith("#  layout"))
    header, first = lines[top], lines[top + 1]
    assert "steps" in header
    emitted = yaml.safe_load(config.read_text())
    groups = emitted["groups"]
    prompting = groups.get("prefill", groups.get("mixed", {})).get("limits", {})
    budget = prompting.get("max_num_batched_tokens", emitted["limits"]["max_num_batched_tokens"])
    decoding = (groups.get("decode") or groups["mixed"]).get("limits", {})
    pace = decoding.get("min_step_interval_ms", 0)
    # The best row's settings are the ones emitted.
    assert f"{budget} tok" + (f", {pace:g} ms" if pace else "") in first
    ClusterConfig.from_yaml(config)


def test_plan_searches_conversation_rates_for_a_multiturn_workload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "--cost", "roofline:llama-3-70b:h100", "--gpus", "8", "--tp", "4",
            "--prompt", "multiturn:4:3", "--output", "fixed:32", "--rate", "1",
            "--min-duration", "2", "--no-mixed", "--routing", "kv_aware",
            "--model-path", str(tmp_path / "model")]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "goodput: conversations started per second" in out and "best:" in out
