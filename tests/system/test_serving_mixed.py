"""End to end, colocated: Ray places 2 mixed workers, the router serves them over gRPC."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from orchestrator.api.client import pb, pb_grpc
from orchestrator.control.controller import ControllerOptions
from tests.system import serving_checks
from tests.system.cluster_helpers import ServedCluster, cluster_config, mixed_groups, pools_full
from tests.waiting import wait_until, wait_until_async

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(ray_local: None, tiny_model_dir: Path) -> Iterator[ServedCluster]:
    served = ServedCluster(
        cluster_config(tiny_model_dir, mixed_groups(2)),
        ControllerOptions(health_interval_seconds=0.5, health_timeout_seconds=5),
    )
    try:
        yield served
    finally:
        served.close()


@pytest.fixture
def stub(cluster: ServedCluster) -> Iterator[pb_grpc.GenerationStub]:
    with grpc.insecure_channel(cluster.address) as channel:
        yield pb_grpc.GenerationStub(channel)


def test_concurrent_outputs_match_the_colocated_engine(
    cluster: ServedCluster, tiny_model_dir: Path
) -> None:
    serving_checks.check_parity(cluster.address, tiny_model_dir)


def test_model_info_and_cluster_state(stub: pb_grpc.GenerationStub, tiny_model_dir: Path) -> None:
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.model_name == tiny_model_dir.name
    assert info.serving_mode == pb.SERVING_MODE_MIXED
    assert info.max_model_len == 256 and info.page_size == 16
    state = stub.GetClusterState(pb.GetClusterStateRequest())
    (group,) = state.groups
    assert group.role == pb.WORKER_ROLE_MIXED and group.num_replicas == 2
    assert {w.worker_id for w in group.workers} == {"mixed-0", "mixed-1"}
    assert all(w.health == pb.WORKER_HEALTH_HEALTHY for w in group.workers)
    assert all(w.num_total_kv_pages == 64 for w in group.workers)


def test_health_and_reflection_answer(cluster: ServedCluster) -> None:
    with grpc.insecure_channel(cluster.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "pdserve.v1.Generation"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = list(
            reflection.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
        )
        names = {s.name for s in replies[0].list_services_response.service}
        assert "pdserve.v1.Generation" in names and "grpc.health.v1.Health" in names


def test_every_bad_request_is_invalid_argument(cluster: ServedCluster) -> None:
    serving_checks.check_bad_requests(cluster.address)


def test_cancel_and_deadline_free_every_page(cluster: ServedCluster) -> None:
    serving_checks.check_cancel_and_deadline(cluster.address)


def test_stop_strings_and_text(stub: pb_grpc.GenerationStub) -> None:
    base = pb.GenerateRequest(
        prompt="abc", sampling=pb.SamplingParams(temperature=0.0, max_tokens=24)
    )
    full = "".join(r.text for r in stub.Generate(base))
    assert len(full) > 4
    stop = full[3:5]
    request = pb.GenerateRequest()
    request.CopyFrom(base)
    request.sampling.stop.append(stop)
    responses = list(stub.Generate(request))
    assert "".join(r.text for r in responses) == full[: full.index(stop)]
    assert responses[-1].finish_reason == "stop"


def test_queue_overflow_is_resource_exhausted(cluster: ServedCluster) -> None:
    router = cluster.app.router
    settings = router.settings
    router.settings = dataclasses.replace(settings, capacity_per_worker=1, max_queue=1)
    try:
        with grpc.insecure_channel(cluster.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            running = [stub.Generate(serving_checks.long_request(), timeout=120) for _ in range(2)]
            for call in running:
                next(call)  # both workers busy
            queued = stub.Generate(serving_checks.long_request(), timeout=120)
            wait_until(
                lambda: stub.GetClusterState(pb.GetClusterStateRequest()).num_queued_requests == 1,
                what="one request queued",
            )
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(serving_checks.long_request(), timeout=60))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            running[0].cancel()
            assert next(queued).request_id  # the queued one got the freed slot
            queued.cancel()
            running[1].cancel()
            wait_until(lambda: pools_full(stub, pb), what="pages freed")
    finally:
        router.settings = settings


def test_failed_worker_ends_its_requests_and_is_replaced(cluster: ServedCluster) -> None:
    import ray

    with grpc.insecure_channel(cluster.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        call = stub.Generate(serving_checks.long_request("doomed"), timeout=120)
        next(call)
        worker_id = cluster.app.router._requests["doomed"].worker_id
        ray.kill(cluster.app.controller.handle_of(worker_id), no_restart=True)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE

        def replaced() -> bool:
            state = stub.GetClusterState(pb.GetClusterStateRequest())
            workers = [w for g in state.groups for w in g.workers]
            return all(w.health == pb.WORKER_HEALTH_HEALTHY for w in workers)

        wait_until(replaced, timeout=120, what=f"{worker_id} replaced")
        assert cluster.app.controller.registry.workers[worker_id].generation == 1
        # Both workers serve again.
        with ThreadPoolExecutor(4) as pool:
            finished = list(
                pool.map(
                    lambda i: (
                        list(
                            stub.Generate(
                                pb.GenerateRequest(
                                    prompt=f"again {i}", sampling=pb.SamplingParams(max_tokens=4)
                                ),
                                timeout=60,
                            )
                        )[-1].finish_reason
                    ),
                    range(4),
                )
            )
        assert all(reason in ("length", "stop") for reason in finished)


def test_unsatisfiable_placement_fails_with_a_clear_error(cluster: ServedCluster) -> None:
    import asyncio

    from orchestrator.control.placement import PlacementError, place_worker, worker_bundles

    bundles = worker_bundles({"CPU": 64.0}, 2)
    with pytest.raises(PlacementError, match=r"not ready after 1 s.*cluster has"):
        asyncio.run(place_worker("pdserve-too-big", bundles, timeout_seconds=1))


def test_a_placement_given_up_by_its_caller_is_removed(cluster: ServedCluster) -> None:
    """A start that is cancelled while its placement group waits (app stopped, start timed
    out) must not leave the group pending: it would be placed later and hold the resources."""
    import asyncio

    from ray.util import placement_group_table

    from orchestrator.control.placement import place_worker, worker_bundles

    def states() -> list[str]:
        table = placement_group_table().values()
        return [g["state"] for g in table if g["name"] == "pdserve-given-up"]

    async def give_up() -> None:
        bundles = worker_bundles({"CPU": 64.0}, 1)
        task = asyncio.ensure_future(place_worker("pdserve-given-up", bundles, 600))
        await wait_until_async(lambda: states() == ["PENDING"], what="the group waiting")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(give_up())
    assert states() == ["REMOVED"]


def test_router_metrics_count_requests(
    stub: pb_grpc.GenerationStub, cluster: ServedCluster
) -> None:
    request = pb.GenerateRequest(prompt="metrics", sampling=pb.SamplingParams(max_tokens=3))
    list(stub.Generate(request, timeout=60))
    registry = cluster.app.metrics_registry
    labels = {"role": "router", "model": cluster.app.config.model.name}
    ttft = registry.get_sample_value("pdserve_time_to_first_token_seconds_count", labels)
    assert ttft is not None and ttft >= 1
    stop_or_length = sum(
        registry.get_sample_value(
            "pdserve_request_success_total", {**labels, "finished_reason": reason}
        )
        or 0
        for reason in ("stop", "length")
    )
    assert stop_or_length >= 1


def test_tensor_parallel_two_worker_matches_the_single_device_engine(
    cluster: ServedCluster, tiny_model_dir: Path
) -> None:
    """One mixed worker of TP 2: a placement group of two STRICT_PACK bundles; the engine runs
    rank 0 in the actor and spawns rank 1. Outputs equal the single-device engine's."""
    groups = {"mixed": {"replicas": 1, "tp": 2, "resources_per_rank": {"cpu": 0.25}}}
    served = ServedCluster(cluster_config(tiny_model_dir, groups))
    try:
        with grpc.insecure_channel(served.address) as channel:
            state = pb_grpc.GenerationStub(channel).GetClusterState(pb.GetClusterStateRequest())
        assert [(w.worker_id, w.tp_size) for w in state.groups[0].workers] == [("mixed-0", 2)]
        serving_checks.check_parity(served.address, tiny_model_dir)
        serving_checks.check_cancel_and_deadline(served.address)
    finally:
        served.close()


@pytest.mark.parametrize(
    ("fixture", "architecture"),
    [
        ("deepseek_model_dir", "DeepseekV3ForCausalLM"),
        ("qwen3_moe_model_dir", "Qwen3MoeForCausalLM"),
    ],
)
def test_moe_models_serve_colocated(
    fixture: str, architecture: str, request: pytest.FixtureRequest, cluster: ServedCluster
) -> None:
    """DeepSeek (MLA + MoE) and Qwen3-MoE on a mixed worker, through the router: the colocated
    engine's tokens (which equal HF transformers', tests/engine/test_engine_parity.py)."""
    model_dir = Path(request.getfixturevalue(fixture))
    served = ServedCluster(cluster_config(model_dir, mixed_groups(1)))
    try:
        with grpc.insecure_channel(served.address) as channel:
            info = pb_grpc.GenerationStub(channel).GetModelInfo(
                pb.GetModelInfoRequest(), timeout=30
            )
        assert info.architecture == architecture
        assert info.kv_latent == (architecture == "DeepseekV3ForCausalLM")
        serving_checks.check_parity(served.address, model_dir)
    finally:
        served.close()
