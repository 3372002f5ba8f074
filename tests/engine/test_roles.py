"""Prefill and decode roles in one process, KV pages copied between their pools.

Also: aborts at every stage leave no page behind, pinned pages survive preemption, a decoder
drops the KV of waiting requests only when that makes room, and pages pinned for one request
cannot be handed to another.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.engine_helpers import (
    GREEDY,
    THREE_TOKENS,
    drain,
    make_engine,
    prompts_of_lengths,
    run_engine,
)
from workers.engine.engine_core import EngineCore
from workers.engine.errors import InvalidRequestError
from workers.engine.kv_cache import copy_pages, read_pages
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import ScheduledChunk
from workers.engine.sequence import SequenceStatus

LENGTHS = [1, 2, 15, 16, 17, 40, 100]
PAGE = 16


@pytest.fixture(scope="module")
def mixed_tokens(tiny_model_dir: Path) -> list[list[int]]:
    return run_engine(make_engine(tiny_model_dir), prompts_of_lengths(LENGTHS, seed=1))


def _prefill(
    engine: EngineCore, prompts: list[list[int]]
) -> tuple[dict[str, tuple[int, ...]], list[ScheduledChunk]]:
    """Run the prefill engine to completion; returns the pages of each request and all chunks."""
    chunks: list[ScheduledChunk] = []
    engine.on_step_scheduled = chunks.extend
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    pages: dict[str, tuple[int, ...]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            assert output.new_token_ids == [] and output.finished
            assert output.finish_reason == "prefilled"
            pages[output.request_id] = output.page_ids
    return pages, chunks


def test_prefill_then_decode_matches_mixed(
    tiny_model_dir: Path, mixed_tokens: list[list[int]]
) -> None:
    prompts = prompts_of_lengths(LENGTHS, seed=1)
    prefill = make_engine(tiny_model_dir, role="prefill", num_pages=40, max_num_batched_tokens=32)
    decode = make_engine(tiny_model_dir, role="decode", num_pages=60)
    decode.allocate_pinned(7)  # so page ids differ between the two sides

    src_pages, chunks = _prefill(prefill, prompts)
    assert prefill.stats.num_sampled_tokens == 0
    assert prefill.layer_progress.read() == (prefill.stats.num_steps, 4)
    # Every prompt token but the last was computed, in page-aligned chunks, exactly once.
    for i, prompt in enumerate(prompts):
        mine = [c for c in chunks if c.request_id == f"r{i}"]
        bounds = [c.start for c in mine] + [mine[-1].end if mine else 0]
        assert bounds[0] == 0 and bounds[-1] == len(prompt) - 1
        assert [c.end for c in mine[:-1]] == bounds[1:-1]  # contiguous, no token twice
        assert all(c.end % PAGE == 0 for c in mine[:-1]) and not any(c.samples for c in mine)
        assert [p for c in mine for p in c.page_ids] == list(src_pages[f"r{i}"])
    assert "r0" not in {c.request_id for c in chunks}  # a 1-token prompt needs no prefill

    for i, prompt in enumerate(prompts):
        request_id = f"r{i}"
        dst = decode.allocate_pinned(decode.num_prefill_pages(len(prompt)))
        copy_pages(prefill.kv_cache, src_pages[request_id], decode.kv_cache, dst)
        assert set(dst).isdisjoint(src_pages[request_id]) or not dst
        prefill.release(request_id)
        decode.add_prefilled_request(request_id, prompt, GREEDY, dst)
    prefill.check_invariants()
    assert prefill.block_manager.num_free_pages == prefill.num_pages

    first_chunks: list[ScheduledChunk] = []
    decode.on_step_scheduled = lambda cs: first_chunks.extend(cs) if not first_chunks else None
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while decode.has_unfinished():
        for output in decode.step():
            tokens[output.request_id].extend(output.new_token_ids)
    # The first decode step runs exactly the last prompt token of each request.
    assert [(c.start, c.end) for c in first_chunks] == [(n - 1, n) for n in LENGTHS]
    assert list(tokens.values()) == mixed_tokens
    decode.check_invariants()
    assert decode.block_manager.num_free_pages == decode.num_pages - 7


def test_awaiting_kv_with_preemption_keeps_pinned_pages(
    tiny_model_dir: Path, mixed_tokens: list[list[int]]
) -> None:
    prompts = prompts_of_lengths(LENGTHS, seed=1)
    prefill = make_engine(tiny_model_dir, role="prefill")
    src_pages, _ = _prefill(prefill, prompts)
    # A pool too small for every request at once forces preemption (recompute on the decoder).
    decode = make_engine(tiny_model_dir, role="decode", num_pages=14)

    waiting_pages = decode.add_request_awaiting_kv("late", prompts[5], GREEDY)
    copy_pages(prefill.kv_cache, src_pages["r5"], decode.kv_cache, waiting_pages)
    snapshot = read_pages(decode.kv_cache, waiting_pages)

    for i in (0, 1, 2, 3, 4, 6):
        dst = decode.allocate_pinned(decode.num_prefill_pages(len(prompts[i])))
        copy_pages(prefill.kv_cache, src_pages[f"r{i}"], decode.kv_cache, dst)
        decode.add_prefilled_request(f"r{i}", prompts[i], GREEDY, dst)
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()
    for _ in range(500):
        for output in decode.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finished:
                finished.add(output.request_id)
        assert all(decode.block_manager.is_pinned(p) for p in waiting_pages)
        if len(finished) == 6:
            break
    assert len(finished) == 6
    assert decode.stats.num_preemptions > 0
    assert read_pages(decode.kv_cache, waiting_pages).equal(snapshot)

    decode.kv_ready("late")
    while decode.has_unfinished():
        for output in decode.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    for i in (0, 1, 2, 3, 4, 6):
        assert tokens[f"r{i}"] == mixed_tokens[i]
    assert tokens["late"] == mixed_tokens[5]
    decode.check_invariants()
    assert decode.block_manager.num_free_pages == decode.num_pages


def _step_until(engine: EngineCore, condition: object, limit: int = 200) -> None:
    for _ in range(limit):
        if callable(condition) and condition():
            return
        engine.step()
    raise AssertionError("condition never met")


@pytest.mark.parametrize("stage", ["waiting", "mid_prefill", "decoding", "finished"])
def test_abort_at_any_stage_frees_every_page(tiny_model_dir: Path, stage: str) -> None:
    engine = make_engine(tiny_model_dir, num_pages=32, max_num_batched_tokens=16, max_num_seqs=1)
    long_prompt, other = prompts_of_lengths([100, 5], seed=2)
    engine.add_request("other", other, GREEDY)
    engine.add_request("x", long_prompt, GREEDY)
    seq = engine._requests["x"]
    if stage == "mid_prefill":
        _step_until(engine, lambda: 0 < seq.num_computed_tokens < 99)
    elif stage == "decoding":
        _step_until(engine, lambda: seq.num_output_tokens > 1)
    elif stage == "finished":
        _step_until(engine, lambda: seq.is_finished)
    assert engine.abort("x") is (stage != "finished")
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == "x"]
    if stage != "finished":
        assert outputs[-1].finish_reason == "abort"
    engine.check_invariants()
    assert engine.block_manager.num_free_pages == 32


def test_abort_prefill_role_and_waiting_for_kv(tiny_model_dir: Path) -> None:
    prefill = make_engine(tiny_model_dir, role="prefill", num_pages=16)
    prefill.add_request("p", prompts_of_lengths([40])[0], GREEDY)
    while prefill.has_unfinished():
        prefill.step()
    assert prefill.pages_of("p") and prefill.abort("p")
    assert prefill.block_manager.num_free_pages == 16

    decode = make_engine(tiny_model_dir, role="decode", num_pages=16)
    decode.add_request_awaiting_kv("d", prompts_of_lengths([40])[0], GREEDY)
    assert decode.block_manager.num_pinned_pages == 3
    assert decode.abort("d")
    while decode.has_unfinished():
        decode.step()
    decode.check_invariants()
    assert decode.block_manager.num_free_pages == 16 and decode.block_manager.num_pinned_pages == 0


def test_pages_pinned_for_incoming_kv_delay_a_decode_but_never_end_it(
    tiny_model_dir: Path,
) -> None:
    """8 pages of 4 tokens: while 4 are pinned for a transfer, a decoding request that needs a
    5th page waits (it fits the pool); once the KV lands it finishes all its tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompt, incoming = prompts_of_lengths([12, 17], seed=4)
    expected = run_engine(make_engine(tiny_model_dir, page_size=4), [prompt, incoming], params)
    prefill = make_engine(tiny_model_dir, role="prefill", page_size=4, num_pages=8)
    prefill.add_request("b", incoming, params)
    while prefill.has_unfinished():
        prefill.step()

    decode = make_engine(tiny_model_dir, role="decode", page_size=4, num_pages=8)
    decode.add_request("a", prompt, params)
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    reasons: dict[str, str | None] = {}

    def step() -> None:
        for output in decode.step():
            tokens[output.request_id].extend(output.new_token_ids)
            if output.finished:
                reasons[output.request_id] = output.finish_reason

    step()  # a's prompt and first token
    pinned = decode.allocate_pinned(decode.num_prefill_pages(len(incoming)))
    assert len(pinned) == 4
    for _ in range(8):
        step()
    assert reasons == {} and len(tokens["a"]) < 10
    copy_pages(prefill.kv_cache, prefill.pages_of("b"), decode.kv_cache, pinned)
    decode.add_prefilled_request("b", incoming, params, pinned)
    while decode.has_unfinished():
        step()
    assert [tokens["a"], tokens["b"]] == expected
    assert reasons == {"a": "length", "b": "length"}
    decode.check_invariants()
    assert decode.block_manager.num_free_pages == 8


def test_waiting_kv_is_kept_when_dropping_it_cannot_make_room(tiny_model_dir: Path) -> None:
    """A (5 pages, no KV) heads the queue; B and C hold 1 page each; 8 pages are pinned for
    transfers, 2 free. Dropping B's and C's KV leaves A 4 pages short: drop nothing."""
    engine = make_engine(tiny_model_dir, role="decode", num_pages=12, page_size=4)
    in_flight = engine.allocate_pinned(8)
    engine.add_request("A", list(range(1, 18)), THREE_TOKENS)  # 17 tokens: 5 pages
    for request_id in "BC":
        pages = engine.allocate_pinned(1)
        engine.add_prefilled_request(request_id, [1, 2, 3, 4, 5], THREE_TOKENS, pages)
    assert engine.block_manager.num_free_pages == 2

    assert engine.step() == []
    assert engine.stats.num_preemptions == 0
    for request_id in "BC":
        seq = engine._requests[request_id]
        assert len(seq.page_ids) == 1 and seq.num_computed_tokens == 4

    engine.free_pinned(in_flight)  # the transfers failed
    assert drain(engine) == {"A": "length", "B": "length", "C": "length"}
    assert engine.stats.num_preemptions == 0
    assert engine.block_manager.num_free_pages == 12


def test_waiting_kv_is_dropped_newest_first_and_only_as_far_as_needed(
    tiny_model_dir: Path,
) -> None:
    """A needs 3 pages, 2 are free: dropping D's 1 page (the newest) is enough; B, C keep KV."""
    engine = make_engine(tiny_model_dir, role="decode", num_pages=12, page_size=4)
    in_flight = engine.allocate_pinned(7)
    engine.add_request("A", list(range(1, 10)), THREE_TOKENS)  # 9 tokens: 3 pages
    for request_id in "BCD":
        pages = engine.allocate_pinned(1)
        engine.add_prefilled_request(request_id, [1, 2, 3, 4, 5], THREE_TOKENS, pages)

    engine.step()
    assert engine.stats.num_preemptions == 1
    seqs = engine._requests
    assert seqs["A"].status is SequenceStatus.RUNNING
    assert seqs["D"].page_ids == [] and seqs["D"].num_computed_tokens == 0
    assert all(seqs[r].num_computed_tokens == 4 and len(seqs[r].page_ids) == 1 for r in "BC")
    engine.free_pinned(in_flight)
    assert set(drain(engine)) == {"A", "B", "C", "D"}


def test_pages_of_a_request_waiting_for_kv_cannot_be_handed_over_or_freed(
    tiny_model_dir: Path,
) -> None:
    engine = make_engine(tiny_model_dir, role="decode", num_pages=16, page_size=4)
    prompt = list(range(1, 10))
    pages = engine.add_request_awaiting_kv("a", prompt, GREEDY)
    with pytest.raises(InvalidRequestError, match="held by another request"):
        engine.add_prefilled_request("b", prompt, GREEDY, pages)
    with pytest.raises(InvalidRequestError, match="held by another request"):
        engine.free_pinned(pages)
    assert all(engine.block_manager.is_pinned(p) for p in pages)
    engine.check_invariants()
    assert engine.abort("a")
    assert drain(engine) == {"a": "abort"}
    assert engine.block_manager.num_free_pages == 16
