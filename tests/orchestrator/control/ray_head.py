"""A ``ray start --head`` node for the tests that need a real Ray job server, and the calls they
make to it (``ray job ...`` and the router's health), shared by the job and signal tests."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.waiting import wait_until

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


def job_server_up(address: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{address}/api/version", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def ray_job(address: str, *args: str) -> str:
    result = subprocess.run(
        [str(RAY), "job", args[0], "--address", address, *args[1:]],
        env=ray_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def router_serving(router: str) -> bool:
    with grpc.insecure_channel(router) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="pdserve.v1.Generation"), timeout=2
            )
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING


def job_status(address: str, job_id: str) -> str:
    from ray.job_submission import JobSubmissionClient

    return str(JobSubmissionClient(address).get_job_status(job_id).value)


@contextmanager
def ray_node(
    log_path: Path, *args: str, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """A ``ray start --block ARGS`` node in a session of its own, with its own temp dir. Ended
    by a SIGTERM to the ``ray start`` process alone, which stops its node (never ``ray stop``,
    which would end every Ray on the machine); its group is killed only if that fails."""
    temp_dir = Path(f"/tmp/pds-{os.getpid()}-{free_port()}")  # short: Ray's sockets live here
    with log_path.open("wb") as log:
        node = subprocess.Popen(
            [
                *(str(RAY), "start", "--block", *args),
                f"--dashboard-agent-listen-port={free_port()}",
                f"--metrics-export-port={free_port()}",
                *(f"--temp-dir={temp_dir}", "--disable-usage-stats"),
            ],
            env=env if env is not None else ray_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield node
    finally:
        node.terminate()
        try:
            node.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)


@contextmanager
def head_node(log_dir: Path, **env: str) -> Iterator[str]:
    """The job server address of a ``ray start --head`` node on loopback (`ray_node`), with free
    ports (the session's in-process Ray may hold the defaults, and a head without its agent
    takes no job)."""
    dashboard_port = free_port()
    with ray_node(
        log_dir / "head.log",
        *("--head", "--node-ip-address=127.0.0.1", f"--port={free_port()}"),
        *("--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}", "--num-cpus=2"),
        env={**ray_env(), **env},
    ):
        address = f"http://127.0.0.1:{dashboard_port}"
        wait_until(lambda: job_server_up(address), timeout=90, what="the Ray job server")
        yield address
