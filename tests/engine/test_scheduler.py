"""Scheduler behaviour without a model: a fake step appends a made-up token when one is due."""

from __future__ import annotations

import pytest

from workers.engine.block_manager import BlockManager
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import Scheduler, SchedulerOutput
from workers.engine.sequence import FinishReason, Sequence, SequenceStatus

PAGE = 4


def _scheduler(num_pages: int = 64, **options: object) -> Scheduler:
    config = EngineConfig(page_size=PAGE, num_pages=num_pages, **options)  # type: ignore[arg-type]
    return Scheduler(config, BlockManager(num_pages, PAGE))


def _seq(request_id: str, num_prompt: int, max_tokens: int = 4, **kw: bool) -> Sequence:
    return Sequence(
        request_id, list(range(num_prompt)), SamplingParams(max_tokens=max_tokens), **kw
    )


def _fake_step(scheduler: Scheduler) -> SchedulerOutput:
    """schedule → postprocess → append token 7 where due → finish at max_tokens / prefill end."""
    out = scheduler.schedule()
    scheduler.postprocess(out)
    for seq, chunk in zip(out.seqs, out.chunks, strict=True):
        if chunk.samples:
            seq.append_token(7, None, 0.0)
            if seq.num_output_tokens >= seq.params.max_tokens:
                scheduler.finish(seq, FinishReason.LENGTH)
        elif seq.prefill_only and seq.num_remaining_tokens == 0:
            scheduler.finish(seq, FinishReason.PREFILLED)
    return out


def _drain(scheduler: Scheduler, max_steps: int = 500) -> list[SchedulerOutput]:
    steps = []
    while scheduler.has_work():
        steps.append(_fake_step(scheduler))
        scheduler.block_manager.check_invariants()
        assert len(steps) < max_steps, "scheduler made no progress"
    return steps


@pytest.mark.parametrize("budget", [4, 8, 13, 64])
def test_budget_respected_and_chunks_page_aligned(budget: int) -> None:
    scheduler = _scheduler(max_num_batched_tokens=budget)
    seqs = [_seq(f"r{i}", n) for i, n in enumerate([1, 3, 17, 30, 5, 41])]
    for seq in seqs:
        scheduler.add(seq)
    steps = _drain(scheduler)
    for out in steps:
        assert 0 < out.num_tokens <= budget
        for chunk in out.chunks:
            seq = next(s for s in seqs if s.request_id == chunk.request_id)
            if chunk.num_tokens > 1:
                assert chunk.start % PAGE == 0, chunk
            if not chunk.samples:  # not a prompt's last chunk
                assert chunk.end % PAGE == 0, chunk
            assert len(chunk.page_ids) == (chunk.end - 1) // PAGE - chunk.start // PAGE + 1
            assert seq.num_prompt_tokens > 0
    assert all(s.status is SequenceStatus.FINISHED and s.num_output_tokens == 4 for s in seqs)
    assert scheduler.block_manager.num_free_pages == 64


def test_chunked_prefill_splits_a_long_prompt_into_page_multiples() -> None:
    scheduler = _scheduler(max_num_batched_tokens=10)
    scheduler.add(_seq("long", 23, max_tokens=1))
    sizes = [out.chunks[0].num_tokens for out in _drain(scheduler)]
    assert sizes == [8, 8, 7]  # 10 rounded down to a page multiple, then the 7-token tail


def test_max_num_seqs_limits_the_batch() -> None:
    scheduler = _scheduler(max_num_seqs=2)
    for i in range(5):
        scheduler.add(_seq(f"r{i}", 3))
    for out in _drain(scheduler):
        assert len(out.seqs) <= 2
        assert len(scheduler.running) <= 2


def test_preemption_by_recompute_when_pages_run_out() -> None:
    # 6 pages of 4 tokens; three sequences growing to 10 tokens need 9 pages together.
    scheduler = _scheduler(num_pages=6, max_num_batched_tokens=64)
    seqs = [_seq(f"r{i}", 6, max_tokens=4) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    steps = _drain(scheduler)
    preempted = [s for out in steps for s in out.preempted]
    assert preempted, "expected a preemption"
    assert all(s.num_output_tokens == 4 for s in seqs)
    assert sum(s.num_preemptions for s in seqs) == len(preempted)
    assert scheduler.block_manager.num_free_pages == 6


def test_pinned_pages_are_never_taken_by_preemption_pressure() -> None:
    scheduler = _scheduler(num_pages=8)
    bm = scheduler.block_manager
    pinned = bm.allocate_pinned(3)
    seqs = [_seq(f"r{i}", 5, max_tokens=6) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    steps = _drain(scheduler)
    assert any(out.preempted for out in steps)
    for out in steps:
        for chunk in out.chunks:
            assert not set(chunk.page_ids) & set(pinned)
    assert all(bm.is_pinned(p) for p in pinned) and bm.num_free_pages == 5
    bm.free_pinned(pinned)
    bm.check_invariants()


def test_pages_pinned_for_a_transfer_delay_a_sequence_but_never_finish_it() -> None:
    # 8 pages of 4 tokens. Once 4 pages are pinned for incoming KV, the 17th token does not fit
    # (5 pages) until the transfer ends; the sequence fits the pool, so it waits.
    scheduler = _scheduler(num_pages=8)
    bm = scheduler.block_manager
    seq = _seq("a", 12, max_tokens=10)
    scheduler.add(seq)
    _fake_step(scheduler)  # the prompt, and a first token: 13 tokens
    pinned = bm.allocate_pinned(4)
    for _ in range(8):
        out = _fake_step(scheduler)
        assert not out.hopeless
        bm.check_invariants()
    assert seq.status is SequenceStatus.WAITING and seq.num_output_tokens < 10
    bm.free_pinned(pinned)  # the transfer failed or timed out (a landed one is handed over)
    _drain(scheduler)
    assert seq.finish_reason is FinishReason.LENGTH and seq.num_output_tokens == 10
    assert bm.num_free_pages == 8


def test_sequence_larger_than_the_pool_is_finished_not_looped() -> None:
    scheduler = _scheduler(num_pages=3, max_num_batched_tokens=64)
    seq = _seq("big", 10, max_tokens=20)  # grows past 12 tokens
    scheduler.add(seq)
    _drain(scheduler)
    # 12 tokens of KV fill the pool; the token sampled from them is the last one.
    assert seq.finish_reason is FinishReason.LENGTH and seq.num_tokens == 13
    assert scheduler.block_manager.num_free_pages == 3


def test_prefill_role_stops_before_the_last_prompt_token_and_never_samples() -> None:
    scheduler = _scheduler(max_num_batched_tokens=8)
    seq = _seq("p", 13, prefill_only=True)
    scheduler.add(seq)
    steps = _drain(scheduler)
    ranges = [(c.start, c.end) for out in steps for c in out.chunks]
    assert ranges == [(0, 8), (8, 12)]
    assert not any(c.samples for out in steps for c in out.chunks)
    assert seq.num_output_tokens == 0 and seq.finish_reason is FinishReason.PREFILLED


def test_decode_admission_runs_only_the_last_prompt_token() -> None:
    scheduler = _scheduler()
    bm = scheduler.block_manager
    pages = bm.allocate_pinned(3)  # KV of 9 prompt tokens written elsewhere
    seq = _seq("d", 10, max_tokens=2)
    bm.unpin(pages)
    seq.page_ids = list(pages)
    seq.num_computed_tokens = 9
    scheduler.add(seq)
    first = _fake_step(scheduler)
    assert [(c.start, c.end, c.samples) for c in first.chunks] == [(9, 10, True)]
    assert first.chunks[0].page_ids == (pages[2],)
    _drain(scheduler)
    assert bm.num_free_pages == 64


def test_illegal_transition_is_refused() -> None:
    seq = _seq("x", 3)
    seq.finish(FinishReason.ABORT)
    with pytest.raises(RuntimeError, match="not allowed"):
        seq.start_running()


def test_prefill_role_reserves_pages_at_admission_and_never_preempts() -> None:
    # 8 pages of 4 tokens; each 13-token prompt needs 3 pages for its 12 prefilled tokens.
    scheduler = _scheduler(num_pages=8, max_num_batched_tokens=4)
    seqs = [_seq(f"p{i}", 13, prefill_only=True) for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    first = scheduler.schedule()
    assert [len(s.page_ids) for s in first.seqs] == [3]  # whole prompt reserved up front
    scheduler.postprocess(first)
    steps = [first, *_drain(scheduler)]
    assert not any(out.preempted for out in steps)
    assert all(s.finish_reason is FinishReason.PREFILLED for s in seqs)
