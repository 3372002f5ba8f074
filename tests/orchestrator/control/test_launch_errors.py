"""`pdserve serve` / `python -m orchestrator.control.launch`: what a user can fix is one line of error
and exit status 2, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.cli.main import main


def test_a_bad_port_variable_fails_only_serve_and_names_the_value(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    env = {**os.environ, "PDSERVE_METRICS_PORT": "abc"}
    other = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli.main", "plan", "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert other.returncode == 0, other.stderr  # every other command is untouched
    monkeypatch.setenv("PDSERVE_METRICS_PORT", "abc")
    with pytest.raises(SystemExit) as exited:
        main(["serve", str(tmp_path / "cluster.yaml")])
    assert exited.value.code == 2
    assert "--metrics-port: not a port number: 'abc'" in capsys.readouterr().err
    monkeypatch.delenv("PDSERVE_METRICS_PORT")
    with pytest.raises(SystemExit):
        main(["serve", str(tmp_path / "cluster.yaml"), "--worker-metrics-port", "70000"])
    assert "70000 is not in [-1, 65535]" in capsys.readouterr().err


def test_missing_tls_files_are_an_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "cluster.yaml"
    config.write_text(
        f"model: {tmp_path / 'absent'}\ngroups:\n  mixed: {{replicas: 1}}\n"
        "router:\n  tls: {cert: missing.pem, key: missing-key.pem}\n"
    )
    assert main(["serve", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: TLSFileError") and "missing.pem" in err
    assert "Traceback" not in err
