"""The launcher Job's script: it stops earlier pdserve jobs, submits, and succeeds only once the
router serves (against a fake `ray` CLI and job SDK)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.ops.helm_chart import (
    CHART,
    one,
    render_values,
)

# --- 4. the launcher ----------------------------------------------------------------------


def _launcher_script(chart: Any, values: dict[str, Any] | None = None) -> str:
    job = one(render_values(chart, values or {}), "Job")
    script: str = job["spec"]["template"]["spec"]["containers"][0]["args"][0]
    return script


# `ray` as the launcher uses it: the job's logs come from the environment, every call is
# recorded. The Python SDK the launcher lists jobs and reads their status with is faked alike.
FAKE_RAY = """#!/bin/sh
echo "$*" >> "$CALLS"
if [ "$1 $2" = "job logs" ]; then printf '%s\\n' "$FAKE_LOGS"; fi
"""
FAKE_SDK = """
import os
from types import SimpleNamespace


class JobSubmissionClient:
    def __init__(self, address=None):
        assert address == os.environ["RAY_ADDRESS"]

    def get_job_status(self, job_id):
        with open(os.environ["CALLS"], "a") as calls:
            calls.write(f"sdk status {job_id}\\n")
        return os.environ["FAKE_STATUS"]

    def list_jobs(self):
        jobs = []
        for entry in os.environ["FAKE_JOBS"].split():
            job_id, status = entry.split("=")
            terminal = status in ("SUCCEEDED", "FAILED", "STOPPED")
            jobs.append(SimpleNamespace(
                submission_id=None if job_id == "-" else job_id,
                status=SimpleNamespace(is_terminal=lambda terminal=terminal: terminal),
            ))
        return jobs
"""


def run_launcher(
    script: str, tmp_path: Path, *, status: str, logs: str = "", jobs: str = ""
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    bin_dir, sdk_dir = tmp_path / "bin", tmp_path / "sdk" / "ray"
    bin_dir.mkdir()
    sdk_dir.mkdir(parents=True)
    (bin_dir / "ray").write_text(FAKE_RAY)
    (bin_dir / "ray").chmod(0o755)
    (bin_dir / "sleep").write_text("#!/bin/sh\nexec /bin/sleep 0.05\n")  # poll fast
    (bin_dir / "sleep").chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    (sdk_dir / "__init__.py").write_text("")
    (sdk_dir / "job_submission.py").write_text(FAKE_SDK)
    calls = tmp_path / "calls"
    calls.touch()
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHONPATH": str(tmp_path / "sdk"),
        "RAY_ADDRESS": "http://head:8265",
        "PDSERVE_REVISION": "3",
        "CALLS": str(calls),
        "FAKE_STATUS": status,
        "FAKE_LOGS": logs,
        "FAKE_JOBS": jobs,
    }
    done = subprocess.run(
        ["/bin/sh", "-ec", script], env=env, capture_output=True, text=True, timeout=60
    )
    return done, calls.read_text().splitlines()


def test_launcher_fails_when_the_driver_fails_at_once(chart: Any, tmp_path: Path) -> None:
    script = _launcher_script(chart)
    done, calls = run_launcher(
        script, tmp_path, status="FAILED", logs="error: router.address: bad port"
    )
    assert done.returncode != 0
    assert "error: router.address: bad port" in done.stdout + done.stderr
    assert any(call.startswith("job submit --submission-id pdserve-3-") for call in calls)


@pytest.mark.parametrize("status", ["STOPPED", "SUCCEEDED"])
def test_launcher_fails_when_the_job_ends_before_serving(
    chart: Any, tmp_path: Path, status: str
) -> None:
    done, _ = run_launcher(_launcher_script(chart), tmp_path, status=status)
    assert done.returncode != 0
    assert "ended before" in done.stdout + done.stderr


def test_launcher_succeeds_once_the_router_serves(chart: Any, tmp_path: Path) -> None:
    logs = "placing workers\npdserve: serving on 0.0.0.0:50051, http 0.0.0.0:8000 (Ctrl-C to stop)"
    done, calls = run_launcher(_launcher_script(chart), tmp_path, status="RUNNING", logs=logs)
    assert done.returncode == 0, done.stdout + done.stderr
    assert any(call.startswith("job logs pdserve-3-") for call in calls)


def test_launcher_gives_up_after_its_ready_timeout(chart: Any, tmp_path: Path) -> None:
    script = _launcher_script(chart, {"launcher": {"readyTimeoutSeconds": 1}})
    done, calls = run_launcher(script, tmp_path, status="RUNNING", logs="placing workers")
    assert done.returncode != 0
    assert "not serving after 1 s" in done.stdout + done.stderr
    assert any(call.startswith("sdk status pdserve-3-") for call in calls)


def test_ready_timeout_defaults_to_a_bounded_wait(chart: Any) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    timeout = values["launcher"]["readyTimeoutSeconds"]
    assert 0 < timeout < values["launcher"]["activeDeadlineSeconds"]
    assert f"READY_TIMEOUT={timeout}" in _launcher_script(chart)


def test_launcher_stops_every_running_pdserve_job_first(chart: Any, tmp_path: Path) -> None:
    jobs = (
        "pdserve-1-100=RUNNING pdserve-2-200=PENDING pdserve-2-150=FAILED other=RUNNING -=RUNNING"
    )
    done, calls = run_launcher(
        _launcher_script(chart),
        tmp_path,
        status="RUNNING",
        logs="pdserve: serving on 0.0.0.0:50051",
        jobs=jobs,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    stops = [call for call in calls if call.startswith("job stop")]
    assert stops == ["job stop pdserve-1-100", "job stop pdserve-2-200"]
    submit = next(i for i, call in enumerate(calls) if call.startswith("job submit"))
    assert submit > max(calls.index(stop) for stop in stops)


@pytest.mark.parametrize("shell", ["sh", "bash", "dash"])
def test_launcher_script_parses(chart: Any, shell: str) -> None:
    if shutil.which(shell) is None:
        pytest.skip(f"no {shell} here")
    script = _launcher_script(chart)
    subprocess.run([shell, "-n", "-c", script], check=True, timeout=30)


def test_the_fake_sdk_matches_rays() -> None:
    """What the launcher's Python lines use of Ray's job SDK, as the fake above stands in."""
    from ray.job_submission import JobDetails, JobStatus, JobSubmissionClient

    assert str(JobStatus.FAILED) == "FAILED" and str(JobStatus.STOPPED) == "STOPPED"
    assert JobStatus.SUCCEEDED.is_terminal() and not JobStatus.PENDING.is_terminal()
    assert callable(JobSubmissionClient.list_jobs) and callable(JobSubmissionClient.get_job_status)
    assert "submission_id" in JobDetails.model_fields
