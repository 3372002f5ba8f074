"""Two Ray nodes on one machine standing in for two hosts: a head on 127.0.0.3 and a node that
joins it from 127.0.0.2, each in its own session, temp dir and ports, neither with
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` (which makes a joining node refuse to start). A
disaggregated job (README: ``ray job submit ... orchestrator.control.launch``) pins the prefill
group to the head and the decode group to the other node by custom resources, with the
defaults: no ``worker_host``, no ``fabric.node``. Each worker then binds and advertises its own
node's IP: the router (on the head) dials the decoder on 127.0.0.2, the decoder's KV comes
over ``tcp;ofi_rxm`` from the prefill worker on 127.0.0.3, answers equal the colocated
engine's, and the job ends cleanly.

That the KV crossed is read from the workers' counters: the decoder computed exactly one
prompt token per request (the last; the rest was written into its pages from the other node)
and the prefill worker all the others. A model path that does not open on a node fails the
start with a message that says so.

The settings that only work on one node are refused once workers land on several
(`check_reachable`, with the records a controller keeps).
"""

from __future__ import annotations

import json
import re
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from orchestrator.api.client import pb, pb_grpc
from orchestrator.config.cluster import ClusterConfig
from orchestrator.control.placement import PlacementError, check_reachable
from orchestrator.control.registry import WorkerRecord
from tests.orchestrator.control.ray_head import (
    free_port,
    job_server_up,
    job_status,
    ray_env,
    ray_job,
    ray_node,
    router_serving,
)
from tests.system import serving_checks
from tests.waiting import wait_until
from workers.engine.tokenizer import load_tokenizer

HEAD_IP, NODE_IP = "127.0.0.3", "127.0.0.2"


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The job server address of a head on ``HEAD_IP`` joined by a node on ``NODE_IP``; they
    advertise the custom resources ``on_head`` and ``on_node``."""
    logs = tmp_path_factory.mktemp("nodes")
    env = ray_env()
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # a joining node refuses to start with it
    gcs_port, dashboard_port = free_port(), free_port()
    head = (
        *("--head", f"--node-ip-address={HEAD_IP}", f"--port={gcs_port}", "--num-cpus=2"),
        *(f"--dashboard-host={HEAD_IP}", f"--dashboard-port={dashboard_port}"),
        f"--resources={json.dumps({'on_head': 4})}",
    )
    node = (
        *(f"--address={HEAD_IP}:{gcs_port}", f"--node-ip-address={NODE_IP}", "--num-cpus=2"),
        f"--resources={json.dumps({'on_node': 4})}",
    )
    with ray_node(logs / "head.log", *head, env=env):
        address = f"http://{HEAD_IP}:{dashboard_port}"
        wait_until(lambda: job_server_up(address), timeout=90, what="the Ray job server")
        with ray_node(logs / "node.log", *node, env=env):
            yield address


def _groups() -> dict[str, dict[str, object]]:
    """Prefill on the head, decode on the other node, the fabric's address left to each."""
    fabric = {"provider": "tcp;ofi_rxm"}
    on = {"prefill": "on_head", "decode": "on_node"}
    return {
        role: {"resources_per_rank": {"cpu": 0.5, "custom": {on[role]: 1}}, "fabric": fabric}
        for role in on
    }


def _submit(address: str, working_dir: Path, config: dict[str, object], *args: str) -> str:
    """Submit ``orchestrator.control.launch cluster.yaml ARGS`` with ``config`` as the
    working directory's only file (as the README's command ships configs/); its job id."""
    working_dir.mkdir()
    (working_dir / "cluster.yaml").write_text(yaml.safe_dump(config))
    job_id = f"pdserve-multinode-{uuid.uuid4().hex[:8]}"
    ray_job(
        address,
        "submit",
        "--no-wait",
        f"--submission-id={job_id}",
        f"--working-dir={working_dir}",
        "--",
        *(sys.executable, "-m", "orchestrator.control.launch", "cluster.yaml", *args),
    )
    return job_id


def test_groups_on_two_nodes_serve_with_the_default_addresses(
    two_nodes: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    router = f"{HEAD_IP}:{free_port()}"
    config = {
        "model": "../.cache/models/tiny",  # --model names the real one
        "dtype": "float32",
        "limits": {"max_model_len": 128, "num_pages": 32, "max_num_batched_tokens": 64},
        "groups": _groups(),  # no worker_host, no fabric.node: each worker's node IP
        "router": {"address": router, "http_address": None, "grace_seconds": 1},
    }
    job_id = _submit(two_nodes, tmp_path / "job", config, "--model", str(tiny_model_dir))
    try:

        def serving() -> bool:
            if job_status(two_nodes, job_id) in ("FAILED", "STOPPED", "SUCCEEDED"):
                pytest.fail(f"the job ended early:\n{ray_job(two_nodes, 'logs', job_id)}")
            return router_serving(router)

        wait_until(serving, timeout=240, what="the job's router")
        serving_checks.check_parity(router, tiny_model_dir)
        with grpc.insecure_channel(router) as channel:
            stub = pb_grpc.GenerationStub(channel)
            state = stub.GetClusterState(pb.GetClusterStateRequest(), timeout=30)
    finally:
        ray_job(two_nodes, "stop", job_id)
    workers = {w.worker_id: w for group in state.groups for w in group.workers}
    assert (workers["prefill-0"].node_ip, workers["decode-0"].node_ip) == (HEAD_IP, NODE_IP)
    tokenizer = load_tokenizer(tiny_model_dir)
    lengths = [len(tokenizer.encode(prompt)) for prompt in serving_checks.PROMPTS]
    assert workers["decode-0"].num_prompt_tokens_computed == len(lengths)
    assert workers["prefill-0"].num_prompt_tokens_computed == sum(n - 1 for n in lengths)

    deadline = time.monotonic() + 60
    while job_status(two_nodes, job_id) not in ("STOPPED", "SUCCEEDED", "FAILED"):
        assert time.monotonic() < deadline, "the job did not end"
        time.sleep(0.5)
    logs = ray_job(two_nodes, "logs", job_id)
    assert job_status(two_nodes, job_id) in ("STOPPED", "SUCCEEDED"), logs
    assert "shutdown complete" in logs, logs


def test_a_node_without_the_model_fails_the_start_clearly(two_nodes: str, tmp_path: Path) -> None:
    router = {"address": f"{HEAD_IP}:{free_port()}", "http_address": None, "grace_seconds": 1}
    config = {"model": "/nonexistent/model", "groups": _groups(), "router": router}
    job_id = _submit(two_nodes, tmp_path / "job", config)
    wait_until(
        lambda: job_status(two_nodes, job_id) in ("FAILED", "STOPPED", "SUCCEEDED"),
        timeout=180,
        what="the job to end",
    )
    logs = ray_job(two_nodes, "logs", job_id)
    assert job_status(two_nodes, job_id) == "FAILED", logs
    # The worker's own error, naming the node it landed on.
    landed = rf"(prefill-0 on node {re.escape(HEAD_IP)}|decode-0 on node {re.escape(NODE_IP)})"
    assert re.search(rf"ModelNotOnNodeError: {landed}: no checkpoint at /nonexistent/model", logs)


def _records(*nodes: str) -> list[WorkerRecord]:
    return [
        WorkerRecord(f"{role}-0", role, 0, node_ip=node)
        for role, node in zip(("prefill", "decode"), nodes, strict=True)
    ]


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"worker_host": "127.0.0.1"}, "worker_host 127.0.0.1 is loopback"),
        ({"fabric": {"provider": "tcp;ofi_rxm", "node": "127.0.0.1"}}, "fabric.node 127.0.0.1"),
        ({"fabric": {"provider": "shm"}}, "shm moves KV within one node only"),
        (
            {"fabric": {"provider": "tcp;ofi_rxm", "nics": ["eth1", "127.0.0.2", "lo"]}},
            r"fabric\.nics: 127\.0\.0\.2, lo on loopback",
        ),
    ],
)
def test_one_node_settings_are_refused_across_nodes(
    changes: dict[str, object], problem: str, tiny_model_dir: Path
) -> None:
    fabric = changes.get("fabric", {"provider": "tcp;ofi_rxm"})
    raw = {
        "model": str(tiny_model_dir),
        "groups": {"prefill": {"fabric": fabric}, "decode": {"fabric": fabric}},
    }
    if "worker_host" in changes:
        raw["worker_host"] = changes["worker_host"]
    config = ClusterConfig.from_dict(raw)
    prefill, decode = _records(HEAD_IP, NODE_IP)
    with pytest.raises(PlacementError, match=problem):
        check_reachable(config, decode, [prefill, decode])
    # On one node the same settings are fine.
    prefill, decode = _records(HEAD_IP, HEAD_IP)
    check_reachable(config, decode, [prefill, decode])
    # The defaults are fine across nodes.
    tcp = {"provider": "tcp;ofi_rxm"}
    default = ClusterConfig.from_dict(
        {
            "model": str(tiny_model_dir),
            "groups": {"prefill": {"fabric": tcp}, "decode": {"fabric": tcp}},
        }
    )
    prefill, decode = _records(HEAD_IP, NODE_IP)
    check_reachable(default, decode, [prefill, decode])
