"""The README's ``ray job submit --working-dir configs -- "$PWD/.venv/bin/python" -m
orchestrator.control.launch CONFIG --model DIR`` against a ``ray start --head`` cluster on loopback: a
disaggregated job (1 prefill : 1 decode, KV over libfabric ``tcp;ofi_rxm``) serves a request and
ends cleanly on stop.

The working directory holds the config alone, as the README says: Ray's upload leaves out
git-ignored files and its copy goes first on ``PYTHONPATH``, so shipping the repository would
shadow the installed packages with a tree that lacks the compiled libfabric binding. Workers
bind every interface (``worker_host: 0.0.0.0``, as the Helm chart does) and advertise the Ray
node's IP, which the router then dials.

The head runs in a process group of its own, with its own temp dir and explicit ports, and is
ended by that group's id (never ``ray stop``, which kills every Ray process on the machine).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.api.client import pb, pb_grpc
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

RAY = Path(sys.executable).with_name("ray")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def ray_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_USAGE_STATS_ENABLED="0",
        RAY_AUTH_MODE="disabled",
    )
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.fixture(scope="module")
def head_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The dashboard (job server) address of a fresh head node."""
    temp_dir = Path(f"/tmp/pds-{uuid.uuid4().hex[:8]}")  # short: Ray's unix sockets live here
    gcs_port, dashboard_port = free_port(), free_port()
    log = (tmp_path_factory.mktemp("head") / "head.log").open("w")
    head = subprocess.Popen(
        [
            str(RAY),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={gcs_port}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard_port}",
            # Free ports, not the fixed defaults: the session's in-process Ray (ray_local) may
            # be up and hold them, and a head without its agent takes no job.
            f"--dashboard-agent-listen-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            "--num-cpus=2",
            f"--temp-dir={temp_dir}",
            "--disable-usage-stats",
        ],
        env=ray_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    address = f"http://127.0.0.1:{dashboard_port}"
    try:
        wait_until(lambda: _job_server_up(address), timeout=90, what="the Ray job server")
        yield address
    finally:
        try:
            os.killpg(head.pid, signal.SIGTERM)
            head.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # already gone
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _job_server_up(address: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{address}/api/version", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def _job(address: str, *args: str) -> str:
    result = subprocess.run(
        [str(RAY), "job", args[0], "--address", address, *args[1:]],
        env=ray_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _serving(router: str) -> bool:
    with grpc.insecure_channel(router) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="pdserve.v1.Generation"), timeout=2
            )
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_job_serves_a_request_and_ends_cleanly(
    head_cluster: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    router = f"127.0.0.1:{free_port()}"
    fabric = {"provider": "tcp;ofi_rxm", "node": "127.0.0.1"}
    working_dir = tmp_path / "job"  # the config alone, as `--working-dir configs` ships it
    working_dir.mkdir()
    (working_dir / "cluster.yaml").write_text(
        yaml.safe_dump(
            {
                # Relative, as in configs/: it would resolve inside Ray's unpacked copy, where
                # no model is; --model names the real one.
                "model": "../.cache/models/tiny",
                "dtype": "float32",
                "worker_host": "0.0.0.0",
                "limits": {"max_model_len": 128, "num_pages": 16, "max_num_batched_tokens": 64},
                "groups": {
                    "prefill": {"resources_per_rank": {"cpu": 0.5}, "fabric": fabric},
                    "decode": {"resources_per_rank": {"cpu": 0.5}, "fabric": fabric},
                },
                "router": {
                    "address": router,
                    "http_address": "127.0.0.1:0",
                    "default_max_tokens": 8,
                    "grace_seconds": 1,
                },
            }
        )
    )
    job_id = f"pdserve-test-{uuid.uuid4().hex[:8]}"
    _job(
        head_cluster,
        "submit",
        "--no-wait",
        f"--submission-id={job_id}",
        f"--working-dir={working_dir}",
        "--",
        sys.executable,  # absolute: the venv is not in the upload
        "-m",
        "orchestrator.control.launch",
        "cluster.yaml",
        "--model",
        str(tiny_model_dir),
    )
    try:

        def serving() -> bool:
            if _status(head_cluster, job_id) in ("FAILED", "STOPPED", "SUCCEEDED"):
                pytest.fail(f"the job ended early:\n{_job(head_cluster, 'logs', job_id)}")
            return _serving(router)

        wait_until(serving, timeout=180, what="the job's router")
        with grpc.insecure_channel(router) as channel:
            stub = pb_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(max_tokens=5))
            responses = list(stub.Generate(request, timeout=60))
        assert responses[-1].finish_reason in ("length", "stop")
        assert responses[-1].usage.completion_tokens >= 1
    finally:
        _job(head_cluster, "stop", job_id)
    deadline = time.monotonic() + 60
    while True:
        status = _status(head_cluster, job_id)
        if status in ("STOPPED", "SUCCEEDED", "FAILED") or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    from ray.job_submission import JobSubmissionClient

    logs = JobSubmissionClient(head_cluster).get_job_logs(job_id)
    assert status in ("STOPPED", "SUCCEEDED"), logs
    assert "shutdown complete" in logs, logs
    assert "prefill-0 (prefill) ready at fabric only" in logs, logs


def _status(address: str, job_id: str) -> str:
    from ray.job_submission import JobSubmissionClient

    return str(JobSubmissionClient(address).get_job_status(job_id).value)
