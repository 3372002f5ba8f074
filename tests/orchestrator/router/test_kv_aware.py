"""The ``kv_aware`` routing policy: the router's estimate of each worker's prefix cache
(`PrefixIndex`), the score that weighs it against load (`KVAware`), the prefill choice that
counts cached tokens as work not to do (`PrefillLoad`), and multi-turn conversations served by
two real mixed workers with prefix caching behind a real router."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from orchestrator.control.registry import Registry, WorkerRecord
from orchestrator.router.core import Router
from orchestrator.router.policy import KVAware, KVAwareWeights, PrefillLoad
from orchestrator.router.prefix_index import PrefixIndex
from orchestrator.router.types import GenerationInput, RouterSettings
from tests.engine.engine_helpers import make_engine, prompts_of_lengths, run_engine
from tests.orchestrator.harness import record
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams
from workers.service.backend import MixedBackend
from workers.service.server import WorkerServer, WorkerServicer

PAGE = 16


def test_the_index_matches_prefixes_block_by_block_and_stays_bounded() -> None:
    index = PrefixIndex(PAGE, max_blocks_per_worker=6)
    history = list(range(100))
    blocks = index.blocks(history)
    assert len(blocks) == 6  # full blocks only
    assert index.blocks(history[:40]) == blocks[:2]  # chained: a prefix's blocks are a prefix
    index.record("a", blocks[:4])
    assert index.matched("a", blocks) == 4
    assert index.matched("b", blocks) == 0
    other = index.blocks([1, *history[1:]])  # first token differs: no block in common
    assert index.matched("a", other) == 0
    index.record("a", other)  # 6 more: the least recently recorded four go
    assert index.matched("a", blocks) == 0 and index.matched("a", other) == 6
    assert index.num_blocks == 6
    index.forget("a")
    assert index.num_blocks == 0


def test_kv_aware_keeps_a_prompt_where_its_prefix_is_until_that_worker_is_overloaded() -> None:
    workers = [record("a"), record("b")]
    policy = KVAware(seed=0, weights=KVAwareWeights(capacity=8, page_size=PAGE))
    blocks = policy.prefixes.blocks(list(range(64)))
    # Nothing known: the least loaded, ties spread.
    assert policy.pick(workers, {"a": 2, "b": 1}, blocks).worker_id == "b"
    assert {policy.pick(workers, {}, blocks).worker_id for _ in range(40)} == {"a", "b"}
    policy.prefixes.record("a", blocks[:3])  # a holds 3 of 4 blocks: 0.75
    assert policy.pick(workers, {"a": 3, "b": 0}, blocks).worker_id == "a"  # 0.75 - 3/8 > 0
    assert policy.pick(workers, {"a": 7, "b": 0}, blocks).worker_id == "b"  # 0.75 - 7/8 < 0
    # A prompt a holds nothing of goes by load alone.
    fresh = policy.prefixes.blocks(list(range(1000, 1064)))
    assert policy.pick(workers, {"a": 0, "b": 1}, fresh).worker_id == "a"


def test_prefill_load_charges_only_the_tokens_a_worker_does_not_hold() -> None:
    workers = [record("p0"), record("p1")]
    load = PrefillLoad(seed=0)
    worker, charged = load.pick(workers, 400, {"p0": 0, "p1": 320}.__getitem__)
    assert (worker.worker_id, charged) == ("p1", 80)
    # p1 has 80 queued; a new 400-token prompt it holds 320 of still costs it least (160 < 400).
    worker, charged = load.pick(workers, 400, {"p0": 0, "p1": 320}.__getitem__)
    assert (worker.worker_id, charged) == ("p1", 80)
    assert load.tokens("p1") == 160
    worker, charged = load.pick(workers, 400)  # no estimate: p0 (0 queued) wins
    assert (worker.worker_id, charged) == ("p0", 400)


def test_multi_turn_conversations_stay_with_the_worker_holding_their_history(
    tiny_model_dir: Path,
) -> None:
    """Two mixed workers with prefix caching behind a ``kv_aware`` router; four conversations
    of three turns, their turns interleaved. Every turn of a conversation goes to the worker
    that served its first, which finds the history cached; answers equal a plain engine's."""
    config = EngineConfig(num_pages=256, max_model_len=1024, enable_prefix_caching=True)
    backends = [MixedBackend(tiny_model_dir, config) for _ in range(2)]
    servers = [
        WorkerServer(WorkerServicer(f"mixed-{i}", backend)) for i, backend in enumerate(backends)
    ]
    system = prompts_of_lengths([48], seed=30)[0]
    questions = [prompts_of_lengths([20, 25, 30], seed=31 + c) for c in range(4)]
    max_tokens = 12
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    plain = make_engine(tiny_model_dir)
    chosen: dict[str, str] = {}

    async def run() -> None:
        registry = Registry()
        for i, server in enumerate(servers):
            registry.add(
                WorkerRecord(f"mixed-{i}", "mixed", i, health="healthy", address=server.address)
            )
        settings = RouterSettings(
            "mixed", False, 320, 1024, 256 * PAGE, 8, 8, max_tokens, policy="kv_aware", seed=1
        )
        router = Router(settings, registry, None)
        assert router.index is not None
        pick = router.policy.pick

        def spy(
            workers: Sequence[WorkerRecord],
            outstanding: dict[str, int],
            blocks: Sequence[bytes] = (),
        ) -> WorkerRecord:
            worker = pick(workers, outstanding, blocks)
            chosen[current] = worker.worker_id
            return worker

        router.policy.pick = spy  # type: ignore[method-assign,assignment]
        history = {c: list(system) for c in range(4)}
        try:
            for turn in range(3):
                for c in range(4):
                    current = f"c{c}-t{turn}"
                    prompt = history[c] + questions[c][turn]
                    request = GenerationInput(
                        current,
                        prompt_token_ids=prompt,
                        sampling={"temperature": 0.0, "ignore_eos": True},
                        max_tokens=max_tokens,
                        return_token_ids=True,
                    )
                    answer = [t async for e in router.generate(request) for t in e.token_ids]
                    assert answer == run_engine(plain, [prompt], greedy)[0]
                    history[c] = prompt + answer
        finally:
            await router.close()

    try:
        asyncio.run(run())
    finally:
        for server in servers:
            server.stop(0.1)
        for backend in backends:
            backend.close()
    for c in range(4):
        assert len({chosen[f"c{c}-t{turn}"] for turn in range(3)}) == 1, chosen
    # Later turns found their history in their worker's cache.
    hits = sum(backend.engine.stats.num_prefix_cache_hits for backend in backends)
    assert hits >= 4 * 2 * 4 * PAGE  # each later turn: at least its 4 full pages of history
