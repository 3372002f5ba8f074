"""A prefill worker killed while requests are routed to it, with retry: a
request whose KV transfer fails before its first token is sent again by its decoder to the
other prefill worker, and every request completes with the colocated engine's greedy tokens.
2P:1D on real Ray, KV over libfabric tcp on loopback; the controller's health interval is long
so that the router still picks the dead worker for a while (the window retry covers)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from orchestrator.api.client import pb, pb_grpc
from orchestrator.control.app import AppOptions
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

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def cluster(ray_local: None, tiny_model_dir: Path) -> Iterator[ServedCluster]:
    served = ServedCluster(
        cluster_config(
            # The transfer deadline is far beyond the clients' timeout: what ends a transfer
            # to the dead worker is a failed send or the decoder's liveness check (1 s).
            tiny_model_dir,
            disaggregated_groups(2, 1),
            transfer={"deadline_seconds": 3600, "liveness_interval_seconds": 1},
        ),
        # No health check during the test: only the router's retry stands between a request
        # and the dead prefill worker.
        ControllerOptions(health_interval_seconds=600, health_timeout_seconds=5),
        # A fixed seed makes the random prefill choices, and so the retries, repeatable.
        AppOptions(seed=3),
    )
    try:
        yield served
    finally:
        served.close()


def test_requests_routed_to_a_killed_prefill_worker_are_retried_on_the_other(
    cluster: ServedCluster, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import ray

    prompts = [[5 + i, 17, 29, 41 + i] * (4 + i) for i in range(8)]
    expected = serving_checks.greedy_reference(tiny_model_dir, prompts, MAX_TOKENS)
    ray.kill(cluster.app.controller.handle_of("prefill-0"), no_restart=True)
    assert cluster.app.controller.registry.workers["prefill-0"].is_ready  # not noticed
    with (
        caplog.at_level(logging.WARNING, logger="orchestrator.router.core"),
        grpc.insecure_channel(cluster.address) as channel,
    ):
        stub = pb_grpc.GenerationStub(channel)
        messages = [
            serving_checks.greedy_request(f"retry-{i}", p, MAX_TOKENS)
            for i, p in enumerate(prompts)
        ]
        with ThreadPoolExecutor(len(messages)) as pool:
            replies = list(pool.map(lambda m: list(stub.Generate(m, timeout=120)), messages))
        got = [[t for r in rs for t in r.token_ids] for rs in replies]
        assert got == expected
        assert all(rs[-1].finish_reason == "length" for rs in replies)
        wait_until(lambda: pools_full(stub, pb), timeout=60, what="every pool full again")
    retried = [r for r in caplog.records if "retrying with prefill-1" in r.getMessage()]
    assert retried, "no request was routed to the killed prefill worker"
    # Every charge of the router's prefill load was released (first tokens, retries).
    for worker_id in ("prefill-0", "prefill-1"):
        labels = {"role": "router", "model": cluster.app.config.model.name, "worker": worker_id}
        name = "pdserve_router_prefill_tokens_in_flight"
        assert cluster.app.metrics_registry.get_sample_value(name, labels) == 0.0, worker_id
