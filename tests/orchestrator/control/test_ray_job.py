"""The README's ``ray job submit --working-dir configs -- "$PWD/.venv/bin/python" -m
orchestrator.control.launch CONFIG --model DIR`` against a ``ray start --head`` cluster on loopback: a
disaggregated job (1 prefill : 1 decode, KV over libfabric ``tcp;ofi_rxm``) serves a request and
ends cleanly on stop.

The working directory holds the config alone, as the README says: Ray's upload leaves out
git-ignored files and its copy goes first on ``PYTHONPATH``, so shipping the repository would
shadow the installed packages with a tree that lacks the compiled libfabric binding. Workers
bind every interface (``worker_host: 0.0.0.0``, as the Helm chart does) and advertise the Ray
node's IP, which the router then dials.

The head node is `ray_head.head_node`: a session of its own, its own temp dir and free ports.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from orchestrator.api.client import pb, pb_grpc
from tests.orchestrator.control.ray_head import (
    free_port,
    head_node,
    job_status,
    ray_job,
    router_serving,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def head_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The dashboard (job server) address of a fresh head node."""
    with head_node(tmp_path_factory.mktemp("head")) as address:
        yield address


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
    ray_job(
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
            if job_status(head_cluster, job_id) in ("FAILED", "STOPPED", "SUCCEEDED"):
                pytest.fail(f"the job ended early:\n{ray_job(head_cluster, 'logs', job_id)}")
            return router_serving(router)

        wait_until(serving, timeout=180, what="the job's router")
        with grpc.insecure_channel(router) as channel:
            stub = pb_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(max_tokens=5))
            responses = list(stub.Generate(request, timeout=60))
        assert responses[-1].finish_reason in ("length", "stop")
        assert responses[-1].usage.completion_tokens >= 1
    finally:
        ray_job(head_cluster, "stop", job_id)
    deadline = time.monotonic() + 60
    while True:
        status = job_status(head_cluster, job_id)
        if status in ("STOPPED", "SUCCEEDED", "FAILED") or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    from ray.job_submission import JobSubmissionClient

    logs = JobSubmissionClient(head_cluster).get_job_logs(job_id)
    assert status in ("STOPPED", "SUCCEEDED"), logs
    assert "shutdown complete" in logs, logs
    assert "prefill-0 (prefill) ready at fabric only" in logs, logs
