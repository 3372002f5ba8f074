"""End to end, disaggregated: prefill workers push KV over libfabric (tcp, loopback) into
decode workers that stream tokens through the router. 1P:3D, and 2P:2D with TP 2."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from orchestrator.api.client import pb, pb_grpc
from orchestrator.control.controller import ControllerOptions
from tests.system import serving_checks
from tests.system.cluster_helpers import (
    ServedCluster,
    cluster_config,
    disaggregated_groups,
    pools_full,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

PREFILL_NICE = 5


@pytest.fixture(scope="module")
def cluster(ray_local: None, tiny_model_dir: Path) -> Iterator[ServedCluster]:
    groups = disaggregated_groups(1, 3)
    groups["prefill"].update(nice=PREFILL_NICE, threads=2)
    served = ServedCluster(
        cluster_config(tiny_model_dir, groups, transfer={"deadline_seconds": 5}),
        ControllerOptions(health_interval_seconds=0.5, health_timeout_seconds=5),
    )
    try:
        yield served
    finally:
        served.close()


def test_concurrent_outputs_match_the_colocated_engine(
    cluster: ServedCluster, tiny_model_dir: Path
) -> None:
    serving_checks.check_parity(cluster.address, tiny_model_dir)


def test_groups_run_at_their_configured_nice_and_threads(cluster: ServedCluster) -> None:
    """groups.prefill.nice: every thread of the prefill worker's process runs at it (so its
    prompt chunks yield the CPU to the decode workers'); the decode workers keep Ray's 0.
    groups.prefill.threads: 2 reaches the process as its OpenMP / torch thread count."""
    workers = cluster.app.controller.registry.workers.values()
    for record in workers:
        with open(f"/proc/{record.pid}/environ", "rb") as environ:
            variables = environ.read().split(b"\0")
        threads = b"2" if record.role == "prefill" else b"1"
        assert b"OMP_NUM_THREADS=" + threads in variables, record.worker_id
        expected = PREFILL_NICE if record.role == "prefill" else 0
        nices = set()
        for tid in os.listdir(f"/proc/{record.pid}/task"):
            with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                nices.add(os.getpriority(os.PRIO_PROCESS, int(tid)))
        assert nices == {expected}, (record.worker_id, nices)


def scrape(port: int) -> dict[str, float]:
    """``/metrics`` of a worker as {sample name: value} (samples of the base labels only)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if set(sample.labels) == {"role", "model"}
    }


def test_every_worker_serves_its_metrics(cluster: ServedCluster) -> None:
    with grpc.insecure_channel(cluster.address) as channel:
        request = pb.GenerateRequest(
            prompt="metrics please", sampling=pb.SamplingParams(max_tokens=3)
        )
        list(pb_grpc.GenerationStub(channel).Generate(request, timeout=60))
    workers = cluster.app.controller.registry.workers
    assert len(workers) == 4 and all(w.metrics_port > 0 for w in workers.values())
    for record in workers.values():
        values = scrape(record.metrics_port)
        assert values["pdserve_kv_pages_capacity"] == 64, record.worker_id
        assert "pdserve_num_requests_running" in values
    # The prefill worker measured the KV it pushed: at least this request's.
    prefill = scrape(workers["prefill-0"].metrics_port)
    assert prefill["pdserve_kv_transfer_bytes_count"] >= 1
    assert prefill["pdserve_kv_transfer_bytes_sum"] > 0
    assert prefill["pdserve_kv_transfer_seconds_count"] >= 1


def test_cluster_state_shows_the_ratio(cluster: ServedCluster) -> None:
    with grpc.insecure_channel(cluster.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        assert stub.GetModelInfo(pb.GetModelInfoRequest()).serving_mode == (
            pb.SERVING_MODE_DISAGGREGATED
        )
        state = stub.GetClusterState(pb.GetClusterStateRequest())
        assert [(g.name, g.num_replicas, len(g.workers)) for g in state.groups] == [
            ("prefill", 1, 1),
            ("decode", 3, 3),
        ]
        healthy = pb.WORKER_HEALTH_HEALTHY
        assert all(w.health == healthy for g in state.groups for w in g.workers)

        # Each worker's token counts: a request of 20 prompt tokens and 5 new ones adds 19
        # computed prompt tokens on the prefill worker, and 1 and 5 sampled on its decoder.
        def totals() -> dict[str, tuple[int, int]]:
            state = stub.GetClusterState(pb.GetClusterStateRequest())
            return {
                g.name: (
                    sum(w.num_prompt_tokens_computed for w in g.workers),
                    sum(w.num_tokens_generated for w in g.workers),
                )
                for g in state.groups
            }

        before = totals()
        request = pb.GenerateRequest(
            prompt_token_ids=list(range(3, 23)),
            sampling=pb.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
        )
        assert list(stub.Generate(request, timeout=60))[-1].usage.completion_tokens == 5
        after = totals()
        assert after["prefill"][0] - before["prefill"][0] == 19
        assert after["prefill"][1] == 0
        assert (
            after["decode"][0] - before["decode"][0],
            after["decode"][1] - before["decode"][1],
        ) == (1, 5)


def test_step_traces_hold_every_step_of_a_request_on_both_sides(cluster: ServedCluster) -> None:
    """What `pdserve calibrate --from-trace` fits: the prefill worker's steps computed the
    prompt but its last token; the decoder's ran one token a step, the first being the last
    prompt token over the pushed KV."""
    from orchestrator.loadgen.compare import step_traces

    def recorded() -> dict[str, int]:
        traces = cluster.run(step_traces(cluster.app))
        return {t["worker_id"]: t["num_recorded"] for t in traces}

    before = recorded()
    prompt, max_tokens = list(range(5, 5 + 70)), 6
    with grpc.insecure_channel(cluster.address) as channel:
        request = pb.GenerateRequest(
            prompt_token_ids=prompt,
            sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )
        list(pb_grpc.GenerationStub(channel).Generate(request, timeout=60))
    traces = cluster.run(step_traces(cluster.app))
    assert sorted(t["role"] for t in traces) == ["decode"] * 3 + ["prefill"]
    new: dict[str, list[list[float]]] = {}
    for trace in traces:
        records = trace["records"]
        count = trace["num_recorded"] - before[trace["worker_id"]]
        new.setdefault(trace["role"], []).extend(records[len(records) - count :])

    def totals(records: list[list[float]]) -> list[float]:
        return [sum(r[k] for r in records) for k in range(3, 7)]

    n = len(prompt) - 1
    assert totals(new["prefill"]) == [n, n * (n + 1) // 2, 0, 0]
    assert len(new["decode"]) == max_tokens
    kv = sum(range(len(prompt), len(prompt) + max_tokens))  # fed at positions n .. n + 5
    assert totals(new["decode"]) == [0, 0, max_tokens, kv]


def test_every_bad_request_is_invalid_argument(cluster: ServedCluster) -> None:
    serving_checks.check_bad_requests(cluster.address)


def test_cancel_and_deadline_free_every_page(cluster: ServedCluster) -> None:
    serving_checks.check_cancel_and_deadline(cluster.address)


def test_a_dead_prefill_worker_fails_requests_then_is_replaced(cluster: ServedCluster) -> None:
    import ray

    with grpc.insecure_channel(cluster.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        ray.kill(cluster.app.controller.handle_of("prefill-0"), no_restart=True)
        # Sent before (or while) the controller notices: it must end, with an error or, once the
        # replacement serves, with tokens; never hang.
        request = pb.GenerateRequest(
            prompt="after the crash", sampling=pb.SamplingParams(max_tokens=4)
        )
        try:
            list(stub.Generate(request, timeout=60))
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error

        def replaced() -> bool:
            state = stub.GetClusterState(pb.GetClusterStateRequest())
            return all(
                w.health == pb.WORKER_HEALTH_HEALTHY for g in state.groups for w in g.workers
            )

        wait_until(replaced, timeout=120, what="prefill-0 replaced")
        assert cluster.app.controller.registry.workers["prefill-0"].generation == 1
        responses = list(stub.Generate(request, timeout=60))
        assert responses[-1].finish_reason in ("length", "stop")
        wait_until(lambda: pools_full(stub, pb), what="every pool full again")


def test_two_by_two_with_tensor_parallel_two(tiny_model_dir: Path, cluster: ServedCluster) -> None:
    # The 1P:3D cluster stays up (module fixture); this one uses what CPU is left.
    served = ServedCluster(cluster_config(tiny_model_dir, disaggregated_groups(2, 2, tp=2)))
    try:
        serving_checks.check_parity(served.address, tiny_model_dir)
        serving_checks.check_cancel_and_deadline(served.address)
    finally:
        served.close()


def test_deepseek_latent_kv_from_two_prefill_ranks(
    deepseek_model_dir: Path, cluster: ServedCluster
) -> None:
    """DeepSeek (MLA + MoE): a TP 2 prefill worker pushes the replicated latent to TP 1
    decoders (any source rank will do) that decode speculatively; answers equal the colocated
    engine's (without speculation), the pushed bytes
    are the latent's (4x less than per-head K and V here), and every pool is full again, after
    cancelled and timed-out requests too."""
    groups = disaggregated_groups(1, 2)
    groups["prefill"]["tp"] = 2
    # The decoders speculate (ngram): several tokens a step through the router, same answers.
    groups["decode"]["speculative"] = {"method": "ngram", "num_speculative_tokens": 3}
    served = ServedCluster(cluster_config(deepseek_model_dir, groups))
    try:
        with grpc.insecure_channel(served.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            assert info.architecture == "DeepseekV3ForCausalLM"
            assert (info.num_kv_heads, info.kv_latent) == (1, True)
            # 3 layers x 80 latent values x 4 bytes.
            assert info.kv_bytes_per_token == 3 * 80 * 4
            serving_checks.check_parity(served.address, deepseek_model_dir)

            workers = served.app.controller.registry.workers
            before = scrape(workers["prefill-0"].metrics_port)["pdserve_kv_transfer_bytes_sum"]
            prompt = list(range(1, 101))  # 100 tokens: 7 pages of 16
            request = pb.GenerateRequest(
                prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=2)
            )
            list(stub.Generate(request, timeout=60))
            moved = scrape(workers["prefill-0"].metrics_port)["pdserve_kv_transfer_bytes_sum"]
            latent_pages = 7 * info.kv_bytes_per_token * 16
            # Whole latent pages of the prompt, plus the small context write (hidden state).
            assert latent_pages <= moved - before < latent_pages + (64 << 10)
            assert moved - before < 4 * latent_pages  # what per-head K and V would take
            drafts = [
                scrape(record.metrics_port)["pdserve_spec_decode_num_draft_tokens_total"]
                for record in workers.values()
                if record.role == "decode"
            ]
            assert sum(drafts) > 0
            wait_until(lambda: pools_full(stub, pb), timeout=30)
        serving_checks.check_cancel_and_deadline(served.address)
    finally:
        served.close()


def test_the_shipped_deepseek_config_serves(
    deepseek_model_dir: Path, cluster: ServedCluster
) -> None:
    """configs/local-1p3d-deepseek.yaml as shipped (1 prefill : 3 decode over tcp, the decoders
    drafting with the MTP module from the prefill's MTP layer and shipped hidden state), with
    the preset written where a test can: answers equal the colocated engine's (without
    speculation), and the decoders drafted."""
    from orchestrator.config.cluster import ClusterConfig

    path = Path(__file__).resolve().parents[2] / "configs" / "local-1p3d-deepseek.yaml"
    config = ClusterConfig.from_yaml(path).with_overrides(
        model=deepseek_model_dir, address="127.0.0.1:0", http_address="none"
    )
    assert config.engine_config("prefill").mtp_kv
    served = ServedCluster(config)
    try:
        serving_checks.check_parity(served.address, deepseek_model_dir)
        workers = served.app.controller.registry.workers
        drafts = [
            scrape(record.metrics_port)["pdserve_spec_decode_num_draft_tokens_total"]
            for record in workers.values()
            if record.role == "decode"
        ]
        assert sum(drafts) > 0
    finally:
        served.close()


def test_qwen3_moe_served_disaggregated(qwen3_moe_model_dir: Path, cluster: ServedCluster) -> None:
    """Qwen3-MoE (GQA KV, experts) 1P:1D through the router: the colocated engine's tokens."""
    served = ServedCluster(cluster_config(qwen3_moe_model_dir, disaggregated_groups(1, 1)))
    try:
        serving_checks.check_parity(served.address, qwen3_moe_model_dir)
        serving_checks.check_cancel_and_deadline(served.address)
    finally:
        served.close()
