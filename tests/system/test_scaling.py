"""Live scaling of a disaggregated cluster (1P:1D on real Ray, real gRPC, KV over libfabric tcp
on loopback): under a steady stream of requests, decode 1 -> 2 -> 1 and prefill 1 -> 2 -> 1.
Every request completes with the colocated engine's greedy tokens (none lost, none failed), a
new worker takes requests once healthy, a removed one finishes its own and leaves the registry,
and every pool is full at the end. Bad scale requests get typed status codes. ``pdserve plan --apply``
scales the cluster to the layout the planner picks, and refuses one that needs another TP size
without scaling anything."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from orchestrator.api.client import pb, pb_grpc
from orchestrator.cli.main import main
from tests.engine.engine_helpers import prompts_of_lengths
from tests.system import serving_checks
from tests.system.cluster_helpers import (
    ServedCluster,
    blocking_channel,
    cluster_config,
    disaggregated_groups,
    pools_full,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
PROMPTS = prompts_of_lengths([20, 45, 70, 33, 90, 12], seed=41)


@pytest.fixture(scope="module")
def cluster(ray_local: None, tiny_model_dir: Path) -> Iterator[ServedCluster]:
    served = ServedCluster(cluster_config(tiny_model_dir, disaggregated_groups(1, 1)))
    try:
        yield served
    finally:
        served.close()


class Load:
    """``clients`` threads sending greedy requests over the prompts until stopped."""

    def __init__(self, address: str, clients: int = 3) -> None:
        self._stop = threading.Event()
        self.results: list[tuple[int, list[int], str]] = []  # (prompt, tokens, error or "")
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(address, c), daemon=True)
            for c in range(clients)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, address: str, client: int) -> None:
        with blocking_channel(address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            n = 0
            while not self._stop.is_set():
                index = (client + n) % len(PROMPTS)
                request = serving_checks.greedy_request(
                    f"load-{client}-{n}", PROMPTS[index], MAX_TOKENS
                )
                tokens: list[int] = []
                error = ""
                try:
                    for response in stub.Generate(request, timeout=120):
                        tokens.extend(response.token_ids)
                except grpc.RpcError as failure:
                    error = f"{failure.code().name}: {failure.details()}"
                with self._lock:
                    self.results.append((index, tokens, error))
                n += 1

    def count(self) -> int:
        with self._lock:
            return len(self.results)

    def stop(self) -> list[tuple[int, list[int], str]]:
        self._stop.set()
        for thread in self._threads:
            thread.join(180)
        return self.results


def generated(stub: pb_grpc.GenerationStub, worker_id: str) -> int:
    state = stub.GetClusterState(pb.GetClusterStateRequest())
    for group in state.groups:
        for worker in group.workers:
            if worker.worker_id == worker_id:
                return int(worker.num_tokens_generated + worker.num_prompt_tokens_computed)
    return -1


def scale(stub: pb_grpc.GenerationStub, group: str, replicas: int) -> pb.ScaleGroupResponse:
    request = pb.ScaleGroupRequest(group=group, replicas=replicas)
    response: pb.ScaleGroupResponse = stub.ScaleGroup(request, timeout=300)
    return response


def test_scaling_under_load_loses_no_request(cluster: ServedCluster, tiny_model_dir: Path) -> None:
    reference = serving_checks.greedy_reference(tiny_model_dir, PROMPTS, MAX_TOKENS)
    registry = cluster.app.controller.registry
    with blocking_channel(cluster.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        load = Load(cluster.address)
        try:
            wait_until(lambda: load.count() >= 6, timeout=120, what="load running")
            # Through the command line, as an operator would.
            argv = ["scale", "--address", cluster.address, "--group", "decode", "--replicas", "2"]
            assert main(argv) == 0
            assert registry.workers["decode-1"].is_ready
            wait_until(
                lambda: generated(stub, "decode-1") > 0, timeout=120, what="decode-1 serving"
            )
            assert scale(stub, "decode", 1).removed == ["decode-1"]
            assert "decode-1" not in registry.workers
            assert scale(stub, "prefill", 2).added == ["prefill-1"]
            wait_until(
                lambda: generated(stub, "prefill-1") > 0, timeout=120, what="prefill-1 serving"
            )
            removed = scale(stub, "prefill", 1).removed
            assert removed == ["prefill-1"] and "prefill-1" not in registry.workers
            done = load.count()
            wait_until(lambda: load.count() >= done + 6, timeout=120, what="load after scaling")
        finally:
            results = load.stop()
        assert [error for _, _, error in results if error] == []
        for index, tokens, _ in results:
            assert tokens == reference[index]
        state = stub.GetClusterState(pb.GetClusterStateRequest())
        assert {g.name: g.num_replicas for g in state.groups} == {"prefill": 1, "decode": 1}
        wait_until(lambda: pools_full(stub, pb), what="every pool full")


def test_bad_scale_requests_are_refused(cluster: ServedCluster) -> None:
    with blocking_channel(cluster.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for group, replicas in (("mixed", 2), ("decode", 0), ("", 1)):
            with pytest.raises(grpc.RpcError) as raised:
                scale(stub, group, replicas)
            assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert (
        main(["scale", "--address", cluster.address, "--group", "decode", "--replicas", "0"]) == 2
    )


def decode_bound_calibration() -> dict[str, object]:
    """Calibration points (`orchestrator.sim.calibrated.fit`) of an engine whose decode steps
    cost 20x its prefill steps: with prompts of 32 tokens and answers of 64, decoding bounds
    the goodput, and of the layouts on 3 GPUs the planner picks 1 prefill : 2 decode."""
    return {
        "num_layers": 4,
        "kv_bytes_per_token": 1024.0,
        "kv_capacity_tokens": 65536,
        "prefill": [
            {"tokens": t, "context": 0, "seconds": 0.001 + 1e-6 * t} for t in (16, 64, 256, 1024)
        ],
        "decode": [
            {"batch": b, "kv_tokens": k, "seconds": 0.02 + 0.002 * b}
            for b, k in ((1, 64), (8, 512), (32, 4096), (16, 128))
        ],
    }


def group_replicas(address: str) -> dict[str, int]:
    with blocking_channel(address) as channel:
        state = pb_grpc.GenerationStub(channel).GetClusterState(pb.GetClusterStateRequest())
    return {group.name: group.num_replicas for group in state.groups}


def test_plan_apply_scales_the_cluster_to_the_planned_layout(
    cluster: ServedCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cost = tmp_path / "calibration.json"
    cost.write_text(json.dumps(decode_bound_calibration()))
    plan = ["plan", "--cost", f"calibrated:{cost}", "--no-mixed", "--num-requests", "20",
            "--prompt", "fixed:32", "--output", "fixed:64", "--min-duration", "1",
            "--ttft-slo", "5", "--tpot-slo", "0.2", "--apply", cluster.address]  # fmt: skip
    assert group_replicas(cluster.address) == {"prefill": 1, "decode": 1}
    # TP 2 only: whichever layout wins, the cluster's TP 1 groups cannot become it by scaling.
    assert main([*plan, "--gpus", "6", "--tp", "2"]) == 1
    captured = capsys.readouterr()
    assert "best: " in captured.out  # the plan itself still printed
    assert "nothing scaled" in captured.err
    assert "decode: the plan wants TP 2, the cluster runs TP 1" in captured.err
    assert group_replicas(cluster.address) == {"prefill": 1, "decode": 1}

    assert main([*plan, "--gpus", "3", "--tp", "1"]) == 0
    out = capsys.readouterr().out
    assert "best: 1P(tp1):2D(tp1)" in out
    applied = out.partition(f"--- applying 1P(tp1):2D(tp1) to {cluster.address} ---\n")[2]
    decode, done = applied.splitlines()  # prefill is already at its planned size
    assert decode.startswith("decode: 1 -> 2 replicas (started: decode-")
    assert done == f"{cluster.address} runs 1P(tp1):2D(tp1)"
    assert group_replicas(cluster.address) == {"prefill": 1, "decode": 2}
    decoders = cluster.app.controller.registry.of_role("decode")
    assert len(decoders) == 2 and all(record.is_ready for record in decoders)
