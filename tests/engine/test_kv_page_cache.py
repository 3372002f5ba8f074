"""Automatic prefix caching: page names, the allocator's cached pages, and greedy parity with
HF transformers when requests reuse each other's KV (sequential and concurrent sharers, a prefix
ending mid-page, eviction under a small pool, preemption, abort of one sharer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.engine_helpers import (
    GREEDY,
    hf_greedy,
    make_engine,
    prompts_of_lengths,
    repetitive_prompts,
    run_engine,
)
from workers.engine.block_manager import BlockManager, PageAllocationError
from workers.engine.cache_events import CacheEventBatch
from workers.engine.config import EngineConfig
from workers.engine.engine_core import EngineCore
from workers.engine.prefix_cache import cache_salt, extend_page_hashes
from workers.engine.sampling_params import SamplingParams
from workers.engine.speculative import SpeculativeConfig

PAGE = 16

# --- page names ----------------------------------------------------------------------------


def test_a_page_name_covers_every_token_before_it() -> None:
    salt = cache_salt("model", "float32", PAGE)
    a = list(range(48))
    b = [*range(47), 999]  # differs in the third page only
    c = [999, *range(1, 48)]  # differs in the first page only
    names_a = extend_page_hashes([], a, PAGE, 3, salt)
    assert extend_page_hashes([], b, PAGE, 3, salt)[:2] == names_a[:2]
    assert extend_page_hashes([], b, PAGE, 3, salt)[2] != names_a[2]
    assert all(
        x != y for x, y in zip(extend_page_hashes([], c, PAGE, 3, salt), names_a, strict=True)
    )
    assert extend_page_hashes([], a, PAGE, 3, cache_salt("other", "float32", PAGE)) != names_a
    # Extending a chain gives the same names as computing it at once; partial pages get none.
    assert extend_page_hashes(names_a[:1], a, PAGE, 3, salt) == names_a
    assert len(extend_page_hashes([], a[:40], PAGE, 3, salt)) == 2


# --- the allocator -------------------------------------------------------------------------


def test_named_pages_stay_cached_when_freed_and_are_evicted_last_freed_last() -> None:
    manager = BlockManager(num_pages=4, page_size=PAGE)
    first = manager.allocate(2)
    manager.register(first[0], b"a")
    manager.register(first[1], b"b")
    manager.register(first[1], b"other")  # a named page keeps its name
    assert manager.lookup([b"a", b"b", b"c"]) == first
    assert manager.lookup([b"b"]) == [first[1]]
    manager.free([first[1]])
    manager.free([first[0]])  # freed after b: evicted after it
    assert manager.num_free_pages == 4 and manager.num_cached_pages == 2
    manager.check_invariants()

    manager.acquire([first[0]])  # a cached page is taken back with its KV
    assert manager.ref_count(first[0]) == 1 and manager.num_cached_pages == 1
    manager.free([first[0]])  # now the most recently freed again
    plain = manager.allocate(2)  # plain free pages go first
    assert set(plain).isdisjoint(first) and manager.num_cached_pages == 2
    (evicted,) = manager.allocate(1)
    assert evicted == first[1]  # least recently freed
    assert manager.lookup([b"b"]) == [] and manager.lookup([b"a"]) == [first[0]]
    manager.free([*plain, evicted])
    manager.check_invariants()
    assert manager.clear_cache() == 1
    assert manager.num_cached_pages == 0 and manager.num_free_pages == 4
    manager.check_invariants()


def test_a_shared_named_page_is_freed_with_its_last_owner() -> None:
    manager = BlockManager(num_pages=2, page_size=PAGE)
    (page,) = manager.allocate(1)
    manager.register(page, b"a")
    manager.acquire([page])
    manager.free([page])
    assert manager.ref_count(page) == 1 and manager.num_cached_pages == 0
    manager.free([page])
    assert manager.num_cached_pages == 1
    manager.check_invariants()


def test_what_cannot_be_named_or_acquired() -> None:
    manager = BlockManager(num_pages=3, page_size=PAGE)
    with pytest.raises(PageAllocationError, match="free or pinned"):
        manager.register(0, b"a")  # free
    (pinned,) = manager.allocate_pinned(1)
    with pytest.raises(PageAllocationError, match="free or pinned"):
        manager.register(pinned, b"a")
    (plain,) = manager.allocate(1)
    with pytest.raises(PageAllocationError, match="not named"):
        manager.acquire([plain])
    manager.check_invariants()


def test_the_pool_reports_the_names_it_gains_and_loses() -> None:
    """What a worker publishes for a router's index (`CacheEvents`): the first batch and any
    after a clear or an overflow are the whole cache; the others, the net change per name."""
    manager = BlockManager(num_pages=3, page_size=PAGE)
    (early,) = manager.allocate(1)
    manager.register(early, b"a")
    events = manager.track_events(capacity=3)
    manager.register(manager.allocate(1)[0], b"b")  # known from the snapshot anyway
    assert events.drain() == CacheEventBatch(stored=(b"a", b"b"), reset=True)
    assert events.drain() == CacheEventBatch()
    (c,) = manager.allocate(1)
    manager.register(c, b"c")
    manager.free([early, c])  # cached, still held
    assert manager.allocate(1) == [early]  # evicts a (freed first)
    assert events.drain() == CacheEventBatch(stored=(b"c",), removed=(b"a",))
    (page,) = manager.allocate(1)  # evicts c ...
    manager.register(page, b"c")  # ... and names another page c: net, still held
    assert events.drain() == CacheEventBatch(stored=(b"c",))
    # Past ``capacity`` changed names the pool stops counting: the next batch is a snapshot.
    manager.free([page])
    for name in (b"d", b"e", b"f", b"g"):
        (page,) = manager.allocate(1)
        manager.register(page, name)
        manager.free([page])
    snapshot = events.drain()
    assert snapshot.reset and set(snapshot.stored) == {b"b", b"g"} and not snapshot.removed
    manager.clear_cache()
    assert events.drain() == CacheEventBatch(reset=True)  # every name forgotten
    manager.check_invariants()


def test_an_engine_publishes_its_cache_only_with_caching_on(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, enable_prefix_caching=True, num_pages=64)
    prompt = prompts_of_lengths([50], seed=5)
    run_engine(engine, prompt)
    batch = engine.drain_cache_events()
    names = extend_page_hashes([], prompt[0], PAGE, 3, engine.cache_salt or b"")
    assert batch is not None and batch.reset and set(names) <= set(batch.stored)
    run_engine(engine, prompt)  # all cached: nothing new
    assert engine.drain_cache_events() == CacheEventBatch()
    assert engine.drain_cache_events(full=True) == batch  # asked in full again
    off = make_engine(tiny_model_dir, num_pages=64)
    assert off.cache_salt is None and off.drain_cache_events() is None


def test_caching_is_refused_with_the_mtp_layer_on_prefill() -> None:
    # A page's MTP-layer KV depends on the token after the page, which its name does not cover.
    with pytest.raises(ValueError, match="mtp_kv with enable_prefix_caching"):
        EngineConfig(role="prefill", enable_prefix_caching=True, mtp_kv=True)


# --- the engine ----------------------------------------------------------------------------

SYSTEM = prompts_of_lengths([40], seed=7)[0]  # 2.5 pages: the shared prefix ends mid-page
SUFFIXES = prompts_of_lengths([9, 23, 17, 30], seed=8)
PROMPTS = [SYSTEM + suffix for suffix in SUFFIXES]


@pytest.fixture(scope="module", params=["tiny", "qwen3", "deepseek"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    """Llama, Qwen3 (QK norm), and DeepSeek: MLA's latent pages are cached like any other."""
    return Path(request.getfixturevalue(f"{request.param}_model_dir"))


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    return [hf_greedy(model_dir, p, GREEDY.max_tokens) for p in PROMPTS]


def _run_one(engine: EngineCore, request_id: str, prompt: list[int]) -> list[int]:
    engine.add_request(request_id, prompt, GREEDY)
    tokens: list[int] = []
    while engine.has_unfinished():
        for output in engine.step():
            tokens.extend(output.new_token_ids)
    return tokens


def _pool_full(engine: EngineCore) -> None:
    engine.check_invariants()
    assert engine.block_manager.num_free_pages == engine.num_pages


def test_a_later_request_reuses_the_shared_prefix(
    model_dir: Path, reference: list[list[int]]
) -> None:
    engine = make_engine(model_dir, enable_prefix_caching=True, max_num_batched_tokens=64)
    assert _run_one(engine, "a", PROMPTS[0]) == reference[0]
    computed = engine.stats.num_computed_prompt_tokens
    assert _run_one(engine, "b", PROMPTS[1]) == reference[1]
    # The two full pages of the shared 40 tokens were reused; the half page was recomputed.
    assert engine.stats.num_prefix_cache_hits == 2 * PAGE
    assert engine.stats.num_computed_prompt_tokens - computed == len(PROMPTS[1]) - 2 * PAGE
    _pool_full(engine)
    assert engine.block_manager.num_cached_pages > 0  # kept for the next request


def test_the_same_prompt_again_recomputes_only_its_last_page(
    model_dir: Path, reference: list[list[int]]
) -> None:
    engine = make_engine(model_dir, enable_prefix_caching=True)
    prompt = PROMPTS[3]  # 70 tokens: 4 full pages, the last token on the fifth
    assert _run_one(engine, "a", prompt) == reference[3]
    assert _run_one(engine, "b", prompt) == reference[3]
    assert engine.stats.num_prefix_cache_hits == 4 * PAGE
    prompt_of_64 = prompt[:64]  # exactly 4 pages: its last token's page is recomputed
    expected = hf_greedy(model_dir, prompt_of_64, GREEDY.max_tokens)
    assert _run_one(engine, "c", prompt_of_64) == expected
    assert engine.stats.num_prefix_cache_hits == 4 * PAGE + 3 * PAGE
    _pool_full(engine)


def test_concurrent_sharers_and_the_abort_of_one(
    model_dir: Path, reference: list[list[int]]
) -> None:
    engine = make_engine(model_dir, enable_prefix_caching=True, max_num_batched_tokens=128)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    engine.add_request("r0", PROMPTS[0], GREEDY)
    for output in engine.step():  # r0's whole prompt: its full pages are named
        tokens[output.request_id].extend(output.new_token_ids)
    assert len(engine.block_manager.lookup(engine.scheduler.page_names(SYSTEM))) == 2
    for i in (1, 2, 3):
        engine.add_request(f"r{i}", PROMPTS[i], GREEDY)
    for output in engine.step():  # all three admitted onto r0's pages
        tokens[output.request_id].extend(output.new_token_ids)
    shared = engine.pages_of("r0")[:2]
    assert all(engine.pages_of(f"r{i}")[:2] == shared for i in (1, 2, 3))
    assert all(engine.block_manager.ref_count(p) == 4 for p in shared)
    assert engine.abort("r2")
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
    assert tokens["r0"] == reference[0]
    assert tokens["r1"] == reference[1] and tokens["r3"] == reference[3]
    _pool_full(engine)


def test_eviction_under_a_small_pool_and_preemption_keep_parity(
    model_dir: Path, reference: list[list[int]]
) -> None:
    # 8 pages: a request needs 4-5; others' cached pages are evicted as new ones need room,
    # and concurrent requests preempt each other.
    engine = make_engine(
        model_dir, enable_prefix_caching=True, num_pages=8, max_num_batched_tokens=32
    )
    others = prompts_of_lengths([60, 70, 50], seed=9)
    for i, prompt in enumerate(others):
        _run_one(engine, f"x{i}", prompt)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
    assert list(tokens.values()) == reference
    assert engine.stats.num_preemptions > 0 and engine.stats.num_prefix_cache_hits > 0
    _pool_full(engine)


def test_speculation_caches_the_pages_its_kept_drafts_fill(model_dir: Path) -> None:
    """ngram drafts with caching on: a turn's kept drafts fill pages (the verify step writes them
    before they are judged, so they are named only once kept); the next turn, the conversation
    so far plus a question, reuses every full page of the first turn's prompt and answer, and
    both turns' tokens are the plain engine's."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = repetitive_prompts([37])[0]
    plain = make_engine(model_dir)
    (answer,) = run_engine(plain, [first], params)
    second = first + answer + prompts_of_lengths([11], seed=3)[0]
    (expected,) = run_engine(plain, [second], params)

    engine = make_engine(
        model_dir,
        enable_prefix_caching=True,
        speculative=SpeculativeConfig(num_speculative_tokens=3),
    )
    assert run_engine(engine, [first], params) == [answer]
    stats = engine.stats
    assert stats.num_accepted_tokens > 0  # some pages were filled by kept drafts
    assert run_engine(engine, [second], params) == [expected]
    # The first turn computed the KV of every token but its last answer token.
    assert stats.num_prefix_cache_hits == (len(first) + len(answer) - 1) // PAGE * PAGE
    _pool_full(engine)


def test_caching_off_names_nothing(model_dir: Path, reference: list[list[int]]) -> None:
    engine = make_engine(model_dir)
    assert _run_one(engine, "a", PROMPTS[0]) == reference[0]
    assert _run_one(engine, "b", PROMPTS[1]) == reference[1]
    assert engine.stats.num_prefix_cache_hits == 0 == engine.stats.num_prefix_cache_queries
    assert engine.block_manager.num_cached_pages == 0


@pytest.mark.slow
def test_tensor_parallel_ranks_share_the_cached_pages(tiny_model_dir: Path) -> None:
    """Under TP every rank holds its heads of the same page ids: rank 0's cache decisions hold
    for all of them."""
    expected = [hf_greedy(tiny_model_dir, p, GREEDY.max_tokens) for p in PROMPTS[:2]]
    engine = make_engine(tiny_model_dir, enable_prefix_caching=True, tensor_parallel_size=2)
    try:
        assert _run_one(engine, "a", PROMPTS[0]) == expected[0]
        assert _run_one(engine, "b", PROMPTS[1]) == expected[1]
        assert engine.stats.num_prefix_cache_hits == 2 * PAGE
        _pool_full(engine)
    finally:
        engine.close()
