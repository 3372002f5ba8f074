"""``pdserve bench`` against a real cluster: 2 mixed workers on Ray, the tiny preset, the
router's gRPC and OpenAI HTTP APIs. Every request is accounted for and the client-side token
counts match the requested lengths (ignore_eos)."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.control.controller import ControllerOptions
from orchestrator.loadgen.clients import GrpcClient, HttpClient
from orchestrator.loadgen.conversations import Turn, measure_conversations, parse_multiturn
from orchestrator.loadgen.records import RequestResult
from orchestrator.loadgen.requests import TimedRequest
from orchestrator.loadgen.session import BenchOptions, measure
from orchestrator.loadgen.stats import SLOs, summarize
from orchestrator.router.prefix_index import PromptPages
from orchestrator.sim.workload import LengthDist, Workload
from tests.system.cluster_helpers import ServedCluster, cluster_config, mixed_groups

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path) -> Iterator[ServedCluster]:
    # No ray_local (tests/conftest.py): ServingApp joins a Ray this
    # process already runs, or starts (and on stop shuts down) an embedded one.
    # kv_aware routing, and each worker's whole prefix cache fetched at every health check.
    config = cluster_config(tiny_model_dir, mixed_groups(2), router={"policy": "kv_aware"})
    served = ServedCluster(config, ControllerOptions(cache_resync_seconds=0.0))
    try:
        yield served
    finally:
        served.close()


def _options(backend: str, max_concurrency: int, rate: float) -> BenchOptions:
    workload = Workload(
        rate=rate,
        num_requests=8,
        prompt=LengthDist.parse("uniform:16-96"),
        output=LengthDist.parse("uniform:4-24"),
        seed=3,
    )
    return BenchOptions(
        workload=workload,
        slos=SLOs(ttft_s=60.0, tpot_s=10.0),  # generous: this asserts accounting, not speed
        num_warmup=1,
        max_concurrency=max_concurrency,
        timeout_s=120.0,
        backend=backend,  # type: ignore[arg-type]
    )


def _check_accounted(results: list[RequestResult], summary: dict[str, object]) -> None:
    assert summary["sent"] == 8
    assert summary["completed"] == 8 and summary["errored"] == 0, summary["errors_by_code"]
    for result in results:
        assert result.finish_reason == "length"
        assert result.output_tokens == result.max_tokens == result.usage_completion_tokens
        assert result.ttft is not None and result.ttft > 0
        assert len(result.itls) == result.output_tokens - 1


def test_grpc_open_loop_run(cluster: ServedCluster, tmp_path: Path) -> None:
    outcome, summary = asyncio.run(measure(cluster.address, None, _options("grpc", 64, 8.0)))
    _check_accounted(outcome.results, summary)
    assert outcome.cap_hits == 0
    assert summary["measured_completed"] == 7
    assert summary["ttft_s"]["p50"] is not None and summary["itl_s"]["p99"] is not None
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])


def test_http_run_under_the_concurrency_cap(cluster: ServedCluster) -> None:
    # All 8 arrive within a few microseconds, so the arrival loop is behind its schedule and
    # creates them back to back; with 2 slots the other 6 wait, and every wait is counted (the
    # count once missed waits of tasks that had not started yet, and this run saw 0).
    url = f"http://{cluster.app.http_address}"
    outcome, summary = asyncio.run(measure(cluster.address, url, _options("http", 2, 1e6)))
    _check_accounted(outcome.results, summary)
    assert outcome.cap_hits == 6 and summary["cap_hits"] == outcome.cap_hits
    assert summary["max_send_lag_s"] > 0


def test_errors_are_counted_by_status(cluster: ServedCluster) -> None:
    # 300 prompt tokens: beyond the cluster's max_model_len (256), refused by the router.
    too_long = TimedRequest(0, 0.0, tuple([5] * 300), 4, warmup=False)

    async def send_both() -> list[RequestResult]:
        results = []
        for client in (
            GrpcClient(cluster.address, 30.0),
            HttpClient(f"http://{cluster.app.http_address}", 30.0),
        ):
            result = RequestResult(0, False, 0.0, 300, 4)
            try:
                await client.send(too_long, result, lambda: 0.0)
            finally:
                await client.close()
            results.append(result)
        return results

    results = asyncio.run(send_both())
    assert [r.error for r in results] == ["INVALID_ARGUMENT", "HTTP 400"]
    summary = summarize(results, SLOs(1.0, 1.0))
    assert summary["errored"] == 2 and summary["completed"] == 0
    assert summary["errors_by_code"] == {"HTTP 400": 1, "INVALID_ARGUMENT": 1}
    assert json.dumps(summary)  # nothing in it that the JSON file cannot hold


def test_multiturn_conversations_carry_their_history(cluster: ServedCluster) -> None:
    """Each turn's prompt is the previous turn's prompt, its answer and a new question, and
    the turns sent are the simulator's (`bench validate` simulates the very same list)."""
    shape = parse_multiturn(
        "multiturn:3:3", system_tokens=24, question_tokens=(4, 12), output_tokens=6, rate=4.0
    )
    slos = SLOs(ttft_s=60.0, tpot_s=10.0)
    turns, summary = asyncio.run(
        measure_conversations(cluster.address, shape, slos, timeout_s=120.0)
    )
    assert summary["completed"] == 9 and summary["errored"] == summary["not_sent"] == 0
    by_conversation: dict[int, list[Turn]] = {}
    for turn in sorted(turns, key=lambda t: (t.conversation, t.turn)):
        by_conversation.setdefault(turn.conversation, []).append(turn)
    systems = {conversation[0].prompt[:24] for conversation in by_conversation.values()}
    assert len(systems) == 1  # one system prompt, shared
    for conversation in by_conversation.values():
        assert all(len(t.result.token_ids) == t.result.output_tokens == 6 for t in conversation)
        assert 24 + 4 <= len(conversation[0].prompt) <= 24 + 12
        for before, after in itertools.pairwise(conversation):
            history = (*before.prompt, *before.result.token_ids)
            assert after.prompt[: len(history)] == history
            assert 4 <= len(after.prompt) - len(history) <= 12
    assert summary["prompt_tokens_sent"] == sum(t.result.prompt_tokens for t in turns)
    sent = sorted(turns, key=lambda t: t.result.index)
    simulated = shape.requests()
    assert [t.result.index for t in sent] == [s.request_id for s in simulated]
    assert [len(t.prompt) for t in sent] == [s.num_prompt_tokens for s in simulated]
    assert [t.result.max_tokens for t in sent] == [s.num_output_tokens for s in simulated]
    assert set(summary["ttft_by_turn_s"]) == {"1", "2", "3"}

    # The router's index as the workers publish it: cleared (as a new router's), it learns at
    # the next health check where each conversation's history is cached.
    index = cluster.app.router.index
    assert index is not None
    workers = list(cluster.app.controller.registry.workers.values())
    for worker in workers:
        assert worker.cache_naming is not None  # prefix caching is on by default
        index.forget(worker.worker_id)
    cluster.run(cluster.app.controller.refresh())
    assert index.num_blocks > 0
    for conversation in by_conversation.values():
        last = conversation[-1]
        history = PromptPages([*last.prompt, *last.result.token_ids[:-1]])
        held = max(index.matched(worker, history) for worker in workers)
        assert held == len(history.token_ids) // 16  # every full page, on one worker


def test_a_multiturn_run_through_the_bench_session(cluster: ServedCluster) -> None:
    """`bench compare / run` with ``--prompt multiturn:C:T``: every turn sent and answered,
    the first ``num_warmup`` by request id left out of the figures."""
    workload = parse_multiturn(
        "multiturn:2:3", system_tokens=16, question_tokens=(4, 8), output_tokens=5, rate=4.0
    )
    options = BenchOptions(
        workload=workload, slos=SLOs(ttft_s=60.0, tpot_s=10.0), num_warmup=2, timeout_s=120.0
    )
    outcome, summary = asyncio.run(measure(cluster.address, None, options))
    assert outcome.backend == "grpc" and outcome.cap_hits == 0
    assert sorted(r.index for r in outcome.results) == list(range(6))
    assert [r.index for r in outcome.results if r.warmup] == [0, 1]
    assert summary["sent"] == 6 and summary["warmup"] == 2 and summary["not_sent"] == 0
    assert summary["completed"] == 6 and summary["errored"] == 0
    # The first conversation's turns 1 and 2 are warm-up (ids 0, 1); its turn 3 is not (id 2).
    ttft = {r.index: r.ttft for r in outcome.results}
    by_turn = summary["ttft_by_turn_s"]
    assert (by_turn["1"]["p50"], by_turn["2"]["p50"]) == (ttft[3], ttft[4])
    assert by_turn["3"]["mean"] == pytest.approx((ttft[2] + ttft[5]) / 2)  # type: ignore[operator]
