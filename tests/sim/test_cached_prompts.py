"""Prefix caching in the simulator: multi-turn conversations (the load generator's shape),
prefill priced on the uncached tokens, KV pushed only for the pages the decoder lacks,
``kv_aware`` routing, and the cache's room."""

from __future__ import annotations

import pytest

from orchestrator.sim.caching import PrefixCache
from orchestrator.sim.conversations import MultiTurnWorkload
from orchestrator.sim.instances import EngineLimits
from orchestrator.sim.metrics import prompt_work, summarize
from orchestrator.sim.options import ServingOptions
from orchestrator.sim.simulator import Layout, simulate
from orchestrator.sim.workload import LengthDist, RequestSpec, Workload
from tests.sim.toy import affine

DISAGGREGATED = Layout(num_prefill=1, num_decode=3)
MIXED = Layout(num_mixed=3)
OFF = ServingOptions(prefix_caching=False)
ON = ServingOptions()
KV_AWARE = ServingOptions(routing="kv_aware")


def _chat(rate: float = 0.5, think: float = 0.0) -> MultiTurnWorkload:
    # bench/multiturn.py's long mix: system 1024, questions 16-32, answers 48.
    return MultiTurnWorkload(
        rate,
        8,
        5,
        LengthDist.parse("fixed:48"),
        system_tokens=1024,
        question=LengthDist("uniform", 16, 32),
        think_time_s=think,
    )


def test_turns_carry_their_conversation_as_the_load_generator_builds_it() -> None:
    workload = _chat()
    specs = workload.requests()
    assert len(specs) == workload.num_requests == 40
    for spec in specs:
        turn = spec.request_id % 5
        assert spec.num_common_tokens == 1024 and spec.conversation == spec.request_id // 5
        if turn:
            before = specs[spec.request_id - 1]
            assert spec.follows == before.request_id
            # The prompt is the previous prompt and answer, then a question of 16-32 tokens.
            assert spec.num_history_tokens == before.num_prompt_tokens + 48
            assert 16 <= spec.num_prompt_tokens - spec.num_history_tokens <= 32
        else:
            assert spec.follows == -1 and spec.num_history_tokens == 0
    # With fixed lengths the longest prompt is the last turn's: every question, every earlier answer.
    fixed = MultiTurnWorkload(1.0, 3, 4, LengthDist.parse("fixed:32"), system_tokens=256,
                              question=LengthDist("uniform", 64, 64))  # fmt: skip
    assert fixed.longest_prompt() == 256 + 4 * 64 + 3 * 32


def test_a_turn_is_sent_after_the_previous_answer_and_the_think_time() -> None:
    result = simulate(affine(), DISAGGREGATED, _chat(think=1.5))
    by_id = {r.request_id: r for r in result.records}
    for record in result.records:
        if record.request_id % 5:
            before = by_id[record.request_id - 1]
            assert record.arrival_time == pytest.approx(before.finish_time + 1.5)


@pytest.mark.parametrize("layout", [DISAGGREGATED, MIXED], ids=lambda x: x.label)
def test_caching_lowers_ttft_and_the_prompt_tokens_computed(layout: Layout) -> None:
    cost, workload = affine(), _chat()
    off = simulate(cost, layout, workload, options=OFF)
    on = simulate(cost, layout, workload, options=ON)
    assert summarize(on).ttft_mean < 0.7 * summarize(off).ttft_mean
    assert prompt_work(off).computed_share == 1.0
    # The shared system prompt alone is most of each first turn; later turns reuse history.
    assert prompt_work(on).computed_share < 0.35


def test_kv_aware_routing_pushes_only_the_pages_the_decoder_lacks() -> None:
    # Conversations overlap at this rate: least-outstanding spreads their turns over the
    # decoders (with nothing outstanding it sends every turn to the first decoder).
    cost, workload = affine(), _chat(rate=8.0)
    off = prompt_work(simulate(cost, DISAGGREGATED, workload, options=OFF))
    on = prompt_work(simulate(cost, DISAGGREGATED, workload, options=ON))
    aware_result = simulate(cost, DISAGGREGATED, workload, options=KV_AWARE)
    aware = prompt_work(aware_result)
    # Every decoder holds the system prompt; kv_aware keeps a conversation on its decoder.
    assert on.transferred_bytes < 0.5 * off.transferred_bytes
    assert aware.transferred_bytes < 0.6 * on.transferred_bytes
    assert aware.transferred_bytes == sum(r.transferred_bytes for r in aware_result.records)
    later = [r for r in aware_result.records if r.request_id % 5]
    # A later turn moves its question and the last answer's tail: under two pages here.
    assert all(r.num_transferred_tokens < 32 + 48 + 2 * 16 for r in later)


def test_a_workload_hit_rate_skips_that_share_of_each_prompt_in_whole_pages() -> None:
    base = Workload(2.0, 60, LengthDist.parse("uniform:500-1500"), LengthDist.parse("fixed:16"))
    hit = Workload(**{**base.__dict__, "prefix_hit": 0.5})
    cold, warm = (simulate(affine(), MIXED, w) for w in (base, hit))
    assert prompt_work(cold).num_cached_tokens == 0
    share = prompt_work(warm).computed_share
    assert 0.5 <= share < 0.52  # rounded down to 16-token pages
    assert summarize(warm).ttft_mean < summarize(cold).ttft_mean
    off = simulate(affine(), MIXED, hit, options=OFF)
    assert prompt_work(off).num_cached_tokens == 0


def test_a_prompt_the_decoder_holds_whole_is_neither_prefilled_nor_pushed() -> None:
    spec = RequestSpec(0, 0.0, 33, 8, num_common_tokens=33)  # 32 KV tokens: two whole pages
    record = simulate(affine(), DISAGGREGATED, [spec]).records[0]  # type: ignore[arg-type]
    assert record.num_transferred_tokens == 0 and record.transferred_bytes == 0
    assert record.prefill_start_time == record.kv_ready_time == record.arrival_time


def test_the_cache_lives_in_free_kv_and_evicts_the_least_recently_kept() -> None:
    cache = PrefixCache(page_size=16, enabled=True)

    def turn(conversation: int, history: int) -> RequestSpec:
        return RequestSpec(0, 0.0, history + 20, 8, conversation=conversation,
                           num_history_tokens=history)  # fmt: skip

    cache.keep(turn(0, 0), 100, room=1000)  # 96 tokens: whole pages
    cache.keep(turn(1, 0), 200, room=1000)
    assert cache.hit(turn(0, 100), 1000) == 96 and cache.num_held_tokens == 96 + 192
    cache.fit(200)  # an admission left room for one: the older goes
    assert cache.hit(turn(0, 100), 1000) == 0 and cache.hit(turn(1, 200), 1000) == 192
    cache.take(turn(1, 200))  # a request owns those pages now
    assert cache.num_held_tokens == 0 and cache.hit(turn(1, 200), 1000) == 0
    assert PrefixCache(16, enabled=False).hit(RequestSpec(0, 0.0, 64, 1, 64), 63) == 0


def test_a_small_pool_evicts_conversations_and_caching_saves_less() -> None:
    workload, options = _chat(rate=2.0), KV_AWARE
    roomy = prompt_work(simulate(affine(), DISAGGREGATED, workload, options=options))
    # Room for one conversation's turn and little else: a later turn finds its history gone
    # when another conversation's turn ran on its decoder meanwhile.
    small = EngineLimits(kv_capacity_tokens=2048)
    tight = prompt_work(simulate(affine(), DISAGGREGATED, workload, small, options))
    assert tight.transferred_bytes > roomy.transferred_bytes
    assert tight.num_cached_tokens < roomy.num_cached_tokens
