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
from orchestrator.router.prefix_index import PrefixIndex, PromptPages
from orchestrator.router.types import GenerationInput, RouterSettings
from tests.engine.engine_helpers import make_engine, prompts_of_lengths, run_engine
from tests.orchestrator.harness import record
from workers.engine.cache_events import CacheEventBatch
from workers.engine.config import EngineConfig
from workers.engine.prefix_cache import cache_salt, extend_page_hashes
from workers.engine.sampling_params import SamplingParams
from workers.service.backend import MixedBackend
from workers.service.server import WorkerServer, WorkerServicer
from workers.wire import CacheNaming

PAGE = 16


NAMING = CacheNaming(cache_salt("model", "float32", PAGE), PAGE)


def cached(worker_id: str, naming: CacheNaming | None = NAMING) -> WorkerRecord:
    """A healthy decode worker with a prefix cache named as ``naming`` says."""
    worker = record(worker_id)
    worker.cache_naming = naming
    return worker


def test_the_index_matches_prefixes_page_by_page_and_stays_bounded() -> None:
    index = PrefixIndex(max_blocks_per_worker=6)
    a, b = cached("a"), cached("b")
    history = list(range(100))
    prompt = PromptPages(history)
    names = prompt.names(NAMING)
    assert len(names) == 6  # full pages only
    assert PromptPages(history[:40]).names(NAMING) == names[:2]  # chained: a prefix's prefix
    # The engine's own names: what the workers publish matches what the router computes.
    assert names == extend_page_hashes([], history, PAGE, 6, NAMING.salt)
    index.record(a, PromptPages(history[:64]))
    assert index.matched(a, prompt) == 4 and index.matched_tokens(a, prompt) == 4 * PAGE
    assert index.share(a, prompt) == 4 / 6
    assert index.matched(b, prompt) == 0
    other = PromptPages([1, *history[1:]])  # first token differs: no page in common
    assert index.matched(a, other) == 0
    index.record(a, other)  # 6 more: the least recently touched four go
    assert index.matched(a, prompt) == 0 and index.matched(a, other) == 6
    assert index.num_blocks == 6
    index.forget("a")
    assert index.num_blocks == 0


def test_the_index_follows_what_workers_publish() -> None:
    index = PrefixIndex(max_blocks_per_worker=100)
    a = cached("a")
    prompt = PromptPages(list(range(80)))
    names = prompt.names(NAMING)
    index.apply(a, CacheEventBatch(stored=tuple(names[:3]), reset=True))
    assert index.matched(a, prompt) == 3
    index.apply(a, CacheEventBatch(stored=tuple(names[3:]), removed=(names[1],)))
    assert index.matched(a, prompt) == 1  # the second page was evicted: the prefix ends there
    index.apply(a, CacheEventBatch(stored=tuple(names[2:4]), reset=True))
    assert index.matched(a, prompt) == 0 and index.num_blocks == 2
    # Another model (another root), or no prefix cache at all: never credited.
    other_model = cached("c", CacheNaming(cache_salt("other", "float32", PAGE), PAGE))
    index.apply(other_model, CacheEventBatch(stored=tuple(names), reset=True))
    assert index.matched(other_model, prompt) == 0
    uncached = cached("d", None)
    index.record(uncached, prompt)
    assert index.matched(uncached, prompt) == 0 and index.share(uncached, prompt) == 0.0


def test_kv_aware_keeps_a_prompt_where_its_prefix_is_until_that_worker_is_overloaded() -> None:
    a, b = cached("a"), cached("b")
    workers = [a, b]
    policy = KVAware(seed=0, weights=KVAwareWeights(capacity=8))
    prompt = PromptPages(list(range(64)))
    # Nothing known: the least loaded, ties spread.
    assert policy.pick(workers, {"a": 2, "b": 1}, prompt).worker_id == "b"
    assert {policy.pick(workers, {}, prompt).worker_id for _ in range(40)} == {"a", "b"}
    policy.prefixes.record(a, PromptPages(list(range(48))))  # a holds 3 of 4 pages: 0.75
    assert policy.pick(workers, {"a": 3, "b": 0}, prompt).worker_id == "a"  # 0.75 - 3/8 > 0
    assert policy.pick(workers, {"a": 7, "b": 0}, prompt).worker_id == "b"  # 0.75 - 7/8 < 0
    # A prompt a holds nothing of goes by load alone.
    fresh = PromptPages(list(range(1000, 1064)))
    assert policy.pick(workers, {"a": 0, "b": 1}, fresh).worker_id == "a"


def test_prefill_load_charges_only_the_tokens_a_worker_does_not_hold() -> None:
    workers = [record("p0"), record("p1")]
    load = PrefillLoad(seed=0)
    held = {"p0": 0, "p1": 320}

    def cached_tokens(worker: WorkerRecord) -> int:
        return held[worker.worker_id]

    worker, charged = load.pick(workers, 400, cached_tokens)
    assert (worker.worker_id, charged) == ("p1", 80)
    # p1 has 80 queued; a new 400-token prompt it holds 320 of still costs it least (160 < 400).
    worker, charged = load.pick(workers, 400, cached_tokens)
    assert (worker.worker_id, charged) == ("p1", 80)
    assert load.tokens("p1") == 160
    worker, charged = load.pick(workers, 400)  # no estimate: p0 (0 queued) wins
    assert (worker.worker_id, charged) == ("p0", 400)


def test_multi_turn_conversations_stay_with_the_worker_holding_their_history(
    tiny_model_dir: Path,
) -> None:
    """Two mixed workers with prefix caching behind a ``kv_aware`` router; four conversations
    of three turns, their turns interleaved. Every turn of a conversation goes to the worker
    that served its first, which finds the history cached; answers equal a plain engine's. A
    fourth turn through a new router, which learns the caches only from what the workers
    publish, goes there too."""
    config = EngineConfig(num_pages=256, max_model_len=1024, enable_prefix_caching=True)
    backends = [MixedBackend(tiny_model_dir, config) for _ in range(2)]
    servers = [
        WorkerServer(WorkerServicer(f"mixed-{i}", backend)) for i, backend in enumerate(backends)
    ]
    system = prompts_of_lengths([48], seed=30)[0]
    questions = [prompts_of_lengths([20, 25, 30, 18], seed=31 + c) for c in range(4)]
    max_tokens = 12
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    plain = make_engine(tiny_model_dir)
    chosen: dict[str, str] = {}

    async def run() -> None:
        registry = Registry()
        for i, server in enumerate(servers):
            worker = WorkerRecord(f"mixed-{i}", "mixed", i, health="healthy")
            worker.address = server.address
            worker.cache_naming = backends[i].cache_naming()
            registry.add(worker)
        settings = RouterSettings(
            "mixed", False, 320, 1024, 256 * PAGE, 8, 8, max_tokens, policy="kv_aware", seed=1
        )

        def spied(router: Router) -> Router:
            pick = router.policy.pick

            def spy(
                workers: Sequence[WorkerRecord],
                outstanding: dict[str, int],
                prompt: PromptPages | None = None,
            ) -> WorkerRecord:
                worker = pick(workers, outstanding, prompt)
                chosen[current] = worker.worker_id
                return worker

            router.policy.pick = spy  # type: ignore[method-assign]
            return router

        async def turn(router: Router, c: int, t: int) -> None:
            nonlocal current
            current = f"c{c}-t{t}"
            prompt = history[c] + questions[c][t]
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

        current = ""
        history = {c: list(system) for c in range(4)}
        router = spied(Router(settings, registry, None))
        try:
            for t in range(3):
                for c in range(4):
                    await turn(router, c, t)
        finally:
            await router.close()
        # A new router knows nothing of these conversations until the workers publish what
        # their caches hold (as the controller hands it over): then each fourth turn goes to
        # the worker holding its history.
        router = spied(Router(settings, registry, None))
        assert router.index is not None and router.index.num_blocks == 0
        for i, backend in enumerate(backends):
            batch = backend.cache_events()
            assert batch is not None and batch.reset  # the first: all the cache holds
            registry.publish_cache_events(f"mixed-{i}", batch)
        assert (
            0
            < router.index.num_blocks
            == sum(backend.engine.block_manager.num_named_pages for backend in backends)
        )
        try:
            for c in range(4):
                await turn(router, c, 3)
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
        assert len({chosen[f"c{c}-t{t}"] for t in range(4)}) == 1, chosen
    # Later turns found their history in their worker's cache.
    hits = sum(backend.engine.stats.num_prefix_cache_hits for backend in backends)
    assert hits >= 4 * 2 * 4 * PAGE  # each later turn: at least its 4 full pages of history
