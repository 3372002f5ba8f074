"""Faults of a disaggregated cluster with real processes (1P:2D on real Ray, real gRPC, KV over
libfabric tcp on loopback): a decode worker killed mid-decode, and one killed
while its requests wait for their KV (they are served by the other decoder), and the only
prefill worker killed (decoders prefill requests themselves until it is replaced).

One cluster for the module. The controller's health interval is longer than the other suites'
on purpose: the router must stop choosing a dead decoder as soon as its stream breaks, not at
the controller's next health check, and a long interval keeps that window open long enough for
the test to see the difference.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
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
from workers.engine.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

LONG_TOKENS = 200
SHORT_TOKENS = 8
HEALTH_INTERVAL_S = 2.0


@pytest.fixture(scope="module")
def cluster(ray_local: None, tiny_model_dir: Path) -> Iterator[ServedCluster]:
    served = ServedCluster(
        cluster_config(
            tiny_model_dir, disaggregated_groups(1, 2), transfer={"deadline_seconds": 5}
        ),
        ControllerOptions(health_interval_seconds=HEALTH_INTERVAL_S, health_timeout_seconds=5),
    )
    try:
        yield served
    finally:
        served.close()


def wait_all_ready(cluster: ServedCluster) -> None:
    """Every worker of the module's cluster ready (an earlier test may have had one replaced)."""
    workers = cluster.app.controller.registry.workers
    wait_until(
        lambda: all(workers[w].is_ready for w in ("decode-0", "decode-1", "prefill-0")),
        timeout=180,
        what="every worker ready",
    )


@dataclass
class Stream:
    """One streaming request in a thread: its tokens, then its finish reason or status code."""

    request_id: str
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    code: grpc.StatusCode | None = None
    thread: threading.Thread | None = None

    def run(self, stub: pb_grpc.GenerationStub, message: pb.GenerateRequest) -> None:
        try:
            for response in stub.Generate(message, timeout=180):
                self.tokens.extend(response.token_ids)
                self.finish_reason = response.finish_reason or self.finish_reason
        except grpc.RpcError as error:
            self.code = error.code()

    def start(self, stub: pb_grpc.GenerationStub, message: pb.GenerateRequest) -> Stream:
        self.thread = threading.Thread(target=self.run, args=(stub, message), daemon=True)
        self.thread.start()
        return self

    def join(self, timeout: float) -> None:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"{self.request_id} did not end"


def decisions(cluster: ServedCluster, worker_id: str) -> float:
    labels = {"role": "router", "model": cluster.app.config.model.name, "worker": worker_id}
    value = cluster.app.metrics_registry.get_sample_value("pdserve_router_decisions_total", labels)
    return value or 0.0


def worker_state(stub: pb_grpc.GenerationStub, worker_id: str) -> pb.WorkerState:
    state = stub.GetClusterState(pb.GetClusterStateRequest())
    (worker,) = [w for g in state.groups for w in g.workers if w.worker_id == worker_id]
    return worker


def run_concurrently(
    stub: pb_grpc.GenerationStub, messages: list[pb.GenerateRequest]
) -> list[list[pb.GenerateResponse]]:
    with ThreadPoolExecutor(len(messages)) as pool:
        return list(pool.map(lambda m: list(stub.Generate(m, timeout=120)), messages))


def test_a_decoder_killed_mid_decode_is_routed_around_and_replaced(
    cluster: ServedCluster, tiny_model_dir: Path
) -> None:
    import ray

    tokenizer = load_tokenizer(tiny_model_dir)
    long_prompts = [tokenizer.encode(f"story {i}: once upon a time there was") for i in range(4)]
    short_prompts = [tokenizer.encode(f"short {i}") for i in range(4)]
    expected_long = serving_checks.greedy_reference(tiny_model_dir, long_prompts, LONG_TOKENS)
    expected_short = serving_checks.greedy_reference(tiny_model_dir, short_prompts, SHORT_TOKENS)
    router = cluster.app.router
    registry = cluster.app.controller.registry

    with grpc.insecure_channel(cluster.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        # Four long streams: least-outstanding routing puts two on each decoder.
        streams = [
            Stream(f"long-{i}").start(
                stub, serving_checks.greedy_request(f"long-{i}", prompt, LONG_TOKENS)
            )
            for i, prompt in enumerate(long_prompts)
        ]
        owner: dict[str, str] = {}

        def all_assigned() -> bool:
            for stream in streams:
                inflight = router._requests.get(stream.request_id)
                if inflight is not None and inflight.worker_id:
                    owner[stream.request_id] = inflight.worker_id
            return len(owner) == len(streams)

        wait_until(all_assigned, timeout=60, what="every long request assigned")
        doomed = [s for s in streams if owner[s.request_id] == "decode-0"]
        survivors = [s for s in streams if owner[s.request_id] == "decode-1"]
        assert doomed and survivors, owner
        wait_until(
            lambda: all(s.tokens for s in doomed), timeout=60, what="decode-0 streaming tokens"
        )
        assert registry.workers["decode-0"].generation == 0
        ray.kill(cluster.app.controller.handle_of("decode-0"), no_restart=True)

        # Its streams end with an error status promptly (bounded wait), never hang nor finish.
        for stream in doomed:
            stream.join(60)
            assert stream.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED), (
                stream.request_id,
                stream.code,
                stream.finish_reason,
            )
            assert len(stream.tokens) < LONG_TOKENS

        # Right after: the router has already stopped choosing decode-0 (its health check may
        # not have run yet); every new request is served by decode-1.
        sent_to_dead = decisions(cluster, "decode-0")
        replies = run_concurrently(
            stub,
            [
                serving_checks.greedy_request(f"after-{i}", p, SHORT_TOKENS)
                for i, p in enumerate(short_prompts)
            ],
        )
        assert [[t for r in rs for t in r.token_ids] for rs in replies] == expected_short
        assert all(rs[-1].finish_reason == "length" for rs in replies)
        if registry.workers["decode-0"].generation == 0:  # not replaced yet: none went there
            assert decisions(cluster, "decode-0") == sent_to_dead

        # Streams on the other decoder are untouched.
        for stream in survivors:
            stream.join(120)
            assert stream.code is None and stream.finish_reason == "length", stream
            index = streams.index(stream)
            assert stream.tokens == expected_long[index], stream.request_id

        # The prefill worker holds nothing for the dead decoder.
        def prefill_idle() -> bool:
            prefill = worker_state(stub, "prefill-0")
            return (
                prefill.num_free_kv_pages == prefill.num_total_kv_pages
                and prefill.num_transfers_in_flight == 0
            )

        wait_until(prefill_idle, timeout=60, what="prefill-0 pool full, no transfer")

        # A replacement decode-0 (generation 1) joins and serves.
        def replaced() -> bool:
            record = registry.workers["decode-0"]
            return record.generation == 1 and record.is_ready

        wait_until(replaced, timeout=180, what="decode-0 replaced")
        before = decisions(cluster, "decode-0")
        # Concurrent requests: least-outstanding sends half of them to the new decode-0.
        replies = run_concurrently(
            stub,
            [
                serving_checks.greedy_request(f"again-{i}", p, SHORT_TOKENS)
                for i, p in enumerate(short_prompts)
            ],
        )
        assert [[t for r in rs for t in r.token_ids] for rs in replies] == expected_short
        assert decisions(cluster, "decode-0") > before
        wait_until(lambda: pools_full(stub, pb), timeout=60, what="every pool full again")


def test_requests_waiting_for_their_kv_on_a_killed_decoder_are_served_by_the_other(
    cluster: ServedCluster, tiny_model_dir: Path
) -> None:
    """Killed before their first token, they never reached the client: the router sends them
    to the other decoder (`router.worker_retries`), and the answers are the colocated engine's.
    They wait for their KV because the prefill worker is stopped (SIGSTOP) meanwhile, well
    within the transfer deadline."""
    import ray

    tokenizer = load_tokenizer(tiny_model_dir)
    prompts = [tokenizer.encode(f"waiting {i}: the weather today") for i in range(4)]
    expected = serving_checks.greedy_reference(tiny_model_dir, prompts, SHORT_TOKENS)
    router = cluster.app.router
    registry = cluster.app.controller.registry
    wait_all_ready(cluster)
    generation = registry.workers["decode-0"].generation
    prefill_pid = registry.workers["prefill-0"].pid
    assert prefill_pid > 0

    with grpc.insecure_channel(cluster.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        os.kill(prefill_pid, signal.SIGSTOP)
        try:
            streams = [
                Stream(f"waiting-{i}").start(
                    stub, serving_checks.greedy_request(f"waiting-{i}", p, SHORT_TOKENS)
                )
                for i, p in enumerate(prompts)
            ]

            def owners() -> dict[str, str]:
                return {
                    s.request_id: inflight.worker_id
                    for s in streams
                    if (inflight := router._requests.get(s.request_id)) and inflight.worker_id
                }

            wait_until(lambda: len(owners()) == len(streams), timeout=30, what="all assigned")
            doomed = [r for r, worker in owners().items() if worker == "decode-0"]
            assert doomed and all(not s.tokens for s in streams), owners()
            ray.kill(cluster.app.controller.handle_of("decode-0"), no_restart=True)
            wait_until(
                lambda: all(owners().get(r) == "decode-1" for r in doomed),
                timeout=30,
                what="the killed decoder's requests sent to the other",
            )
        finally:
            # A stop longer than its health check's timeout (a failed run) got it replaced.
            with contextlib.suppress(ProcessLookupError):
                os.kill(prefill_pid, signal.SIGCONT)

        for stream, want in zip(streams, expected, strict=True):
            stream.join(120)
            assert (stream.code, stream.finish_reason) == (None, "length"), stream
            assert stream.tokens == want, stream.request_id

        def replaced() -> bool:
            record = registry.workers["decode-0"]
            return record.generation > generation and record.is_ready

        wait_until(replaced, timeout=180, what="decode-0 replaced")
        wait_until(lambda: pools_full(stub, pb), timeout=60, what="every pool full again")


def test_while_the_only_prefill_worker_is_down_decoders_prefill_requests_themselves(
    cluster: ServedCluster, tiny_model_dir: Path
) -> None:
    """`router.local_prefill_fallback`: requests sent right after the prefill worker is killed
    (its KV transfers fail: the decoders notice within a second) and while it is replaced are
    prefilled by their decoders, token-identical to the colocated engine."""
    import ray

    tokenizer = load_tokenizer(tiny_model_dir)
    prompts = [tokenizer.encode(f"no prefill {i}: a long way home") for i in range(4)]
    expected = serving_checks.greedy_reference(tiny_model_dir, prompts, SHORT_TOKENS)
    registry = cluster.app.controller.registry
    wait_all_ready(cluster)
    generation = registry.workers["prefill-0"].generation
    with grpc.insecure_channel(cluster.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        ray.kill(cluster.app.controller.handle_of("prefill-0"), no_restart=True)
        replies = run_concurrently(
            stub,
            [
                serving_checks.greedy_request(f"no-prefill-{i}", p, SHORT_TOKENS)
                for i, p in enumerate(prompts)
            ],
        )
        assert [[t for r in rs for t in r.token_ids] for rs in replies] == expected
        assert all(rs[-1].finish_reason == "length" for rs in replies)
        # The replacement serves again, and nothing is left behind.
        wait_until(
            lambda: (
                registry.workers["prefill-0"].generation > generation
                and registry.workers["prefill-0"].is_ready
            ),
            timeout=180,
            what="prefill-0 replaced",
        )
        replies = run_concurrently(
            stub,
            [
                serving_checks.greedy_request(f"prefill-back-{i}", p, SHORT_TOKENS)
                for i, p in enumerate(prompts)
            ],
        )
        assert [[t for r in rs for t in r.token_ids] for rs in replies] == expected
        wait_until(lambda: pools_full(stub, pb), timeout=60, what="every pool full again")
