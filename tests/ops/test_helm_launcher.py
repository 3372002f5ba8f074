"""Review fixes of the Helm chart: router ports against each other and Ray's, the CUDA rules,
byte sizes and quantities the orchestrator would refuse, and the launcher's wait for its job."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from orchestrator.config import ClusterConfig, ConfigError
from tests.ops.test_helm import CHART, NAMESPACE, RELEASE, cluster_yaml, one

EFA_GPU: dict[str, Any] = {
    "fabric": {"provider": "efa", "rdmaResource": "vpc.amazonaws.com/efa"},
    "workerGroups": {
        "prefill": {"gpuPerRank": 1, "rdmaDevicesPerPod": 1},
        "decode": {"gpuPerRank": 1, "rdmaDevicesPerPod": 1},
    },
}


@pytest.fixture(scope="module")
def pdserve_chart() -> Iterator[Any]:
    with helm.Chart.load(str(CHART)) as loaded:
        yield loaded


def render_values(chart: Any, values: dict[str, Any]) -> list[dict[str, Any]]:
    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    docs: list[dict[str, Any]] = []
    for path, text in manifests.items():
        if path.endswith(".yaml"):
            docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs


def _with(path: str, value: object, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """``base`` (or {}) with the dotted ``path`` set to ``value``."""
    values: dict[str, Any] = yaml.safe_load(yaml.safe_dump(base or {}))
    node = values
    *parents, leaf = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return values


# --- 1. router ports ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "ports",
    [
        {"grpcPort": 8000, "httpPort": 8000},
        {"httpPort": 9400, "metricsPort": 9400},
        {"grpcPort": 9400, "metricsPort": 9400},
    ],
)
def test_router_ports_must_differ(pdserve_chart: Any, ports: dict[str, int]) -> None:
    with pytest.raises(helm.HelmError, match="the router's ports must differ"):
        pdserve_chart.render({"router": ports}, name=RELEASE)


@pytest.mark.parametrize(
    ("key", "port"),
    [
        ("grpcPort", 6379),
        ("httpPort", 8265),
        ("metricsPort", 10001),
        ("metricsPort", 8080),
        ("grpcPort", 52365),
    ],
)
def test_router_ports_avoid_rays_own(pdserve_chart: Any, key: str, port: int) -> None:
    with pytest.raises(helm.HelmError, match=rf"router\.{key}: {port} is the Ray .* port"):
        pdserve_chart.render({"router": {key: port}}, name=RELEASE)


def test_worker_metrics_port_avoids_rays_own(pdserve_chart: Any) -> None:
    with pytest.raises(helm.HelmError, match=r"workerMetricsPort: 8080 is the Ray metrics"):
        pdserve_chart.render({"workerMetricsPort": 8080}, name=RELEASE)


def test_distinct_router_ports_render_a_valid_service(pdserve_chart: Any) -> None:
    ports = {"grpcPort": 9000, "httpPort": 9001, "metricsPort": 9002}
    docs = render_values(pdserve_chart, {"router": ports})
    service = one(docs, "Service", "demo-pdserve-router")
    assert sorted(p["port"] for p in service["spec"]["ports"]) == [9000, 9001, 9002]
    config = ClusterConfig.from_dict(cluster_yaml(docs))
    assert (config.router.port, config.router.http_host_port) == (9000, ("0.0.0.0", 9001))


# --- 2. the CUDA rules --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            # An RDMA provider, but no GPUs (the default gpuPerRank 0).
            {
                "clusterConfig": {"device": "cuda"},
                "fabric": EFA_GPU["fabric"],
                "workerGroups": {
                    "prefill": {"rdmaDevicesPerPod": 1},
                    "decode": {"rdmaDevicesPerPod": 1},
                },
            },
            r"workerGroups\.decode\.gpuPerRank: clusterConfig\.device cuda runs",
        ),
        (
            _with(
                "workerGroups.prefill.gpuPerRank",
                0,
                _with("clusterConfig.device", "cuda:1", EFA_GPU),
            ),
            r"workerGroups\.prefill\.gpuPerRank: clusterConfig\.device cuda:1 runs",
        ),
        (
            {
                "clusterConfig": {"device": "cuda"},
                "workerGroups": {"prefill": {"gpuPerRank": 1}, "decode": {"gpuPerRank": 1}},
            },
            r"fabric\.provider: tcp;ofi_rxm cannot register GPU memory",
        ),
        (
            # auto runs on the GPU a rank reserves: the same rule as cuda (orchestrator/config.py).
            {"clusterConfig": {"device": "auto"}, "workerGroups": {"decode": {"gpuPerRank": 1}}},
            r"fabric\.provider: tcp;ofi_rxm cannot register GPU memory .*auto",
        ),
    ],
)
def test_cuda_device_needs_gpus_and_a_gpu_memory_provider(
    pdserve_chart: Any, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmError, match=message):
        pdserve_chart.render(values, name=RELEASE)


@pytest.mark.parametrize(
    "values",
    [
        _with("clusterConfig.device", "cuda", EFA_GPU),
        _with("clusterConfig.device", "auto", EFA_GPU),
        _with("clusterConfig.device", "auto"),  # no GPUs: auto is cpu, tcp is fine
        {"workerGroups": {"decode": {"gpuPerRank": 1}}},  # device cpu leaves KV in host memory
    ],
)
def test_cuda_rules_pass_what_the_orchestrator_takes(
    pdserve_chart: Any, values: dict[str, Any]
) -> None:
    config = ClusterConfig.from_dict(cluster_yaml(render_values(pdserve_chart, values)))
    assert config.device == values.get("clusterConfig", {}).get("device", "cpu")


# --- 3. byte sizes and quantities ---------------------------------------------------------


def _python_accepts(key: str, size: str, raw: dict[str, Any]) -> bool:
    raw = _with(key, size, raw)
    try:
        ClusterConfig.from_dict(raw)
    except ConfigError:
        return False
    return True


SIZES = [
    # (size, accepted as router.max_request_bytes, accepted as kv_memory_bytes)
    ("4MiB", True, True),
    ("1KiB", True, True),
    ("1GiB", True, True),
    ("1 GB", True, True),
    ("2GiB", False, True),
    ("1.5GiB", False, True),
    ("1000B", False, True),
    ("0.5KiB", False, True),
    ("0.5B", False, False),
    ("0B", False, False),
    ("0", False, False),
    ("0.0GiB", False, False),
]


@pytest.mark.parametrize(("size", "as_request", "as_kv"), SIZES)
def test_sizes_pass_the_chart_as_they_pass_the_orchestrator(
    pdserve_chart: Any, size: str, as_request: bool, as_kv: bool
) -> None:
    raw = cluster_yaml(render_values(pdserve_chart, {}))
    cases = [
        ("clusterConfig.router.max_request_bytes", "router.max_request_bytes", as_request),
        ("clusterConfig.limits.kv_memory_bytes", "limits.kv_memory_bytes", as_kv),
        (
            "workerGroups.decode.limits.kv_memory_bytes",
            "groups.decode.limits.kv_memory_bytes",
            as_kv,
        ),
    ]
    for value_key, config_key, accepted in cases:
        assert _python_accepts(config_key, size, raw) == accepted, (config_key, size)
        values = _with(value_key, size)
        if accepted:
            render_values(pdserve_chart, values)
        else:
            with pytest.raises(helm.HelmError, match=value_key.rpartition(".")[2]):
                render_values(pdserve_chart, values)


@pytest.mark.parametrize(
    "values",
    [
        _with("clusterConfig.router.max_request_bytes", "0B"),
        _with("clusterConfig.limits.kv_memory_bytes", "0GiB"),
        _with("workerGroups.prefill.limits.kv_memory_bytes", "000"),
        _with("head.cpu", "0"),
        _with("head.cpu", "0m"),
        _with("head.memory", "0"),
        _with("head.memory", "0.0Gi"),
        _with("workerGroups.decode.memory", "0Gi"),
    ],
)
def test_schema_refuses_zero_sizes(pdserve_chart: Any, values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmError):
        pdserve_chart.validate_schema(values)


@pytest.mark.parametrize(
    "values",
    [_with("head.cpu", "500m"), _with("head.cpu", "0.5"), _with("head.memory", "10Gi")],
)
def test_schema_takes_small_nonzero_quantities(pdserve_chart: Any, values: dict[str, Any]) -> None:
    pdserve_chart.validate_schema(values)


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


def test_launcher_fails_when_the_driver_fails_at_once(pdserve_chart: Any, tmp_path: Path) -> None:
    script = _launcher_script(pdserve_chart)
    done, calls = run_launcher(
        script, tmp_path, status="FAILED", logs="error: router.address: bad port"
    )
    assert done.returncode != 0
    assert "error: router.address: bad port" in done.stdout + done.stderr
    assert any(call.startswith("job submit --submission-id pdserve-3-") for call in calls)


@pytest.mark.parametrize("status", ["STOPPED", "SUCCEEDED"])
def test_launcher_fails_when_the_job_ends_before_serving(
    pdserve_chart: Any, tmp_path: Path, status: str
) -> None:
    done, _ = run_launcher(_launcher_script(pdserve_chart), tmp_path, status=status)
    assert done.returncode != 0
    assert "ended before" in done.stdout + done.stderr


def test_launcher_succeeds_once_the_router_serves(pdserve_chart: Any, tmp_path: Path) -> None:
    logs = "placing workers\npdserve: serving on 0.0.0.0:50051, http 0.0.0.0:8000 (Ctrl-C to stop)"
    done, calls = run_launcher(
        _launcher_script(pdserve_chart), tmp_path, status="RUNNING", logs=logs
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert any(call.startswith("job logs pdserve-3-") for call in calls)


def test_launcher_gives_up_after_its_ready_timeout(pdserve_chart: Any, tmp_path: Path) -> None:
    script = _launcher_script(pdserve_chart, {"launcher": {"readyTimeoutSeconds": 1}})
    done, calls = run_launcher(script, tmp_path, status="RUNNING", logs="placing workers")
    assert done.returncode != 0
    assert "not serving after 1 s" in done.stdout + done.stderr
    assert any(call.startswith("sdk status pdserve-3-") for call in calls)


def test_ready_timeout_defaults_to_a_bounded_wait(pdserve_chart: Any) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    timeout = values["launcher"]["readyTimeoutSeconds"]
    assert 0 < timeout < values["launcher"]["activeDeadlineSeconds"]
    assert f"READY_TIMEOUT={timeout}" in _launcher_script(pdserve_chart)


def test_launcher_stops_every_running_pdserve_job_first(pdserve_chart: Any, tmp_path: Path) -> None:
    jobs = (
        "pdserve-1-100=RUNNING pdserve-2-200=PENDING pdserve-2-150=FAILED other=RUNNING -=RUNNING"
    )
    done, calls = run_launcher(
        _launcher_script(pdserve_chart),
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
def test_launcher_script_parses(pdserve_chart: Any, shell: str) -> None:
    if shutil.which(shell) is None:
        pytest.skip(f"no {shell} here")
    script = _launcher_script(pdserve_chart)
    subprocess.run([shell, "-n", "-c", script], check=True, timeout=30)


def test_the_fake_sdk_matches_rays() -> None:
    """What the launcher's Python lines use of Ray's job SDK, as the fake above stands in."""
    from ray.job_submission import JobDetails, JobStatus, JobSubmissionClient

    assert str(JobStatus.FAILED) == "FAILED" and str(JobStatus.STOPPED) == "STOPPED"
    assert JobStatus.SUCCEEDED.is_terminal() and not JobStatus.PENDING.is_terminal()
    assert callable(JobSubmissionClient.list_jobs) and callable(JobSubmissionClient.get_job_status)
    assert "submission_id" in JobDetails.model_fields
