"""Engine fixes from review: waiting KV kept when dropping it cannot help, ids refused while
their abort output is pending, held-back text of a request that outgrew the pool, atomic page
hand-over checks, and cancelled timed-out step-loop calls."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.engine.engine_helpers import GREEDY, make_engine
from workers.engine import LLM, SamplingParams
from workers.engine.block_manager import BlockManager, PageAllocationError
from workers.engine.engine_core import EngineCore
from workers.engine.errors import EngineCallTimeoutError, InvalidRequestError
from workers.engine.sequence import SequenceStatus
from workers.engine.step_loop import StepLoop

DEADLINE_S = 30.0  # bounds a wait for something that should happen within milliseconds
THREE = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def _drain(engine: EngineCore) -> dict[str, str | None]:
    reasons: dict[str, str | None] = {}
    for _ in range(500):
        if not engine.has_unfinished():
            break
        for output in engine.step():
            if output.finished:
                reasons[output.request_id] = output.finish_reason
    assert not engine.has_unfinished(), "engine made no progress"
    engine.check_invariants()
    return reasons


# --- 1. dropping waiting KV ----------------------------------------------------------------


def test_waiting_kv_is_kept_when_dropping_it_cannot_make_room(tiny_model_dir: Path) -> None:
    """A (5 pages, no KV) heads the queue; B and C hold 1 page each; 8 pages are pinned for
    transfers, 2 free. Dropping B's and C's KV leaves A 4 pages short: drop nothing."""
    engine = make_engine(tiny_model_dir, role="decode", num_pages=12, page_size=4)
    in_flight = engine.allocate_pinned(8)
    engine.add_request("A", list(range(1, 18)), THREE)  # 17 tokens: 5 pages
    for request_id in "BC":
        engine.add_prefilled_request(request_id, [1, 2, 3, 4, 5], THREE, engine.allocate_pinned(1))
    assert engine.block_manager.num_free_pages == 2

    assert engine.step() == []
    assert engine.stats.num_preemptions == 0
    for request_id in "BC":
        seq = engine._requests[request_id]
        assert len(seq.page_ids) == 1 and seq.num_computed_tokens == 4

    engine.free_pinned(in_flight)  # the transfers failed
    assert _drain(engine) == {"A": "length", "B": "length", "C": "length"}
    assert engine.stats.num_preemptions == 0
    assert engine.block_manager.num_free_pages == 12


def test_waiting_kv_is_dropped_newest_first_and_only_as_far_as_needed(
    tiny_model_dir: Path,
) -> None:
    """A needs 3 pages, 2 are free: dropping D's 1 page (the newest) is enough; B, C keep KV."""
    engine = make_engine(tiny_model_dir, role="decode", num_pages=12, page_size=4)
    in_flight = engine.allocate_pinned(7)
    engine.add_request("A", list(range(1, 10)), THREE)  # 9 tokens: 3 pages
    for request_id in "BCD":
        engine.add_prefilled_request(request_id, [1, 2, 3, 4, 5], THREE, engine.allocate_pinned(1))

    engine.step()
    assert engine.stats.num_preemptions == 1
    seqs = engine._requests
    assert seqs["A"].status is SequenceStatus.RUNNING
    assert seqs["D"].page_ids == [] and seqs["D"].num_computed_tokens == 0
    assert all(seqs[r].num_computed_tokens == 4 and len(seqs[r].page_ids) == 1 for r in "BC")
    engine.free_pinned(in_flight)
    assert set(_drain(engine)) == {"A", "B", "C", "D"}


# --- 2. an id whose abort output is pending ----------------------------------------------


def test_id_is_refused_until_its_abort_output_is_out(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, num_pages=64, page_size=4)
    engine.add_request("X", [1, 2, 3, 4, 5], THREE)
    engine.step()
    assert engine.abort("X")
    with pytest.raises(InvalidRequestError, match="still ending; its final output comes"):
        engine.add_request("X", [9, 9, 9], THREE)
    engine.check_invariants()
    assert engine.block_manager.num_free_pages == 64  # nothing allocated for the refused one

    outputs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("X", "abort")]
    engine.add_request("X", [9, 9, 9], THREE)  # the old X is gone: the id is free again
    assert _drain(engine) == {"X": "length"}


def test_decode_role_id_is_refused_while_its_abort_output_is_pending(
    tiny_model_dir: Path,
) -> None:
    engine = make_engine(tiny_model_dir, role="decode", num_pages=16, page_size=4)
    prompt = list(range(1, 10))
    engine.add_request_awaiting_kv("X", prompt, GREEDY)
    assert engine.abort("X")
    pinned = engine.allocate_pinned(engine.num_prefill_pages(len(prompt)))
    with pytest.raises(InvalidRequestError, match="still ending"):
        engine.add_request_awaiting_kv("X", prompt, GREEDY)
    with pytest.raises(InvalidRequestError, match="still ending"):
        engine.add_prefilled_request("X", prompt, GREEDY, pinned)
    assert all(engine.block_manager.is_pinned(p) for p in pinned)  # not handed over
    assert engine.block_manager.num_pinned_pages == len(pinned)
    engine.check_invariants()
    assert _drain(engine) == {"X": "abort"}
    engine.add_prefilled_request("X", prompt, THREE, pinned)
    assert _drain(engine) == {"X": "length"}


# --- 3. held-back text of a request that outgrew the pool ----------------------------------


def test_request_outgrowing_the_pool_keeps_its_held_back_text(tiny_model_dir: Path) -> None:
    """8 pages of 4 tokens: the request ends ``length`` at 32 tokens. A stop string that never
    matches holds back its last 9 characters; they must still reach the text."""
    with LLM(tiny_model_dir, num_pages=8, page_size=4, max_model_len=256) as llm:
        params = SamplingParams(
            temperature=0.0, max_tokens=100, ignore_eos=True, stop=["zzzzzzzzzz"]
        )
        (result,) = llm.generate([[65, 66, 67, 68]], params)
        assert result.finish_reason == "length" and len(result.token_ids) < 100
        assert result.text == llm.tokenizer.decode(result.token_ids)
        assert len(result.text) >= 9  # long enough that the held-back tail matters
        llm.engine.check_invariants()


# --- 4. page hand-over checks --------------------------------------------------------------


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
    assert _drain(engine) == {"a": "abort"}
    assert engine.block_manager.num_free_pages == 16


def test_refused_page_transitions_change_nothing() -> None:
    manager = BlockManager(8, 4)
    (pinned,) = manager.allocate_pinned(1)
    (allocated,) = manager.allocate(1)

    def unchanged() -> None:
        manager.check_invariants()
        assert manager.is_pinned(pinned) and manager.ref_count(pinned) == 1
        assert not manager.is_pinned(allocated) and manager.ref_count(allocated) == 1
        assert manager.num_free_pages == 6

    with pytest.raises(PageAllocationError, match="not pinned"):
        manager.free_pinned([pinned, allocated])
    unchanged()
    with pytest.raises(PageAllocationError, match="not pinned"):
        manager.unpin([pinned, allocated])
    unchanged()
    with pytest.raises(PageAllocationError, match="repeat"):
        manager.free_pinned([pinned, pinned])
    unchanged()
    with pytest.raises(PageAllocationError, match="pinned"):
        manager.free([allocated, pinned])
    unchanged()
    with pytest.raises(PageAllocationError, match="freed twice"):
        manager.free([allocated, allocated])
    unchanged()
    manager.free_pinned([pinned])
    manager.free([allocated])
    manager.check_invariants()
    assert manager.num_free_pages == 8


# --- 5. timed-out step-loop calls ------------------------------------------------------------


def test_timed_out_call_that_never_started_never_runs(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    loop = StepLoop("test-step", engine, lambda outputs: None)
    # Not started yet: nothing can run the call before it times out.
    with pytest.raises(EngineCallTimeoutError, match="will not run") as info:
        loop.call(lambda: engine.add_request("late", [1, 2, 3], GREEDY), timeout=0.01)
    assert info.value.started is False and isinstance(info.value, TimeoutError)
    loop.thread.start()
    try:
        assert loop.call(engine.has_unfinished, timeout=DEADLINE_S) is False
    finally:
        loop.stop()
    assert loop.error is None


def test_timed_out_call_is_not_failed_again_when_the_loop_stops(tiny_model_dir: Path) -> None:
    loop = StepLoop("test-step", make_engine(tiny_model_dir), lambda outputs: None)
    with pytest.raises(EngineCallTimeoutError):
        loop.call(lambda: 1, timeout=0.01)
    loop.stop()  # fails what is queued; the cancelled call takes no exception
    assert loop.is_closed


def test_timed_out_call_already_running_says_so(tiny_model_dir: Path) -> None:
    loop = StepLoop("test-step", make_engine(tiny_model_dir), lambda outputs: None)
    loop.thread.start()
    release = threading.Event()
    ran: list[int] = []
    undone: list[int] = []  # calls that ran when the undo did

    def slow() -> int:
        release.wait(DEADLINE_S)
        ran.append(1)
        return 1

    try:
        # The loop normally starts the call at once; should it not within the timeout, the
        # call is cancelled instead (never run, nothing to undo): try again with a longer one.
        for timeout in (0.2, 1.0, 5.0):
            try:
                loop.call(slow, timeout=timeout, undo=lambda: undone.append(len(ran)))
            except EngineCallTimeoutError as error:
                if error.started:
                    assert "still running" in str(error)
                    break
                assert ran == []
        else:
            pytest.fail("the loop never started the call")
        release.set()
        loop.call(lambda: None, timeout=DEADLINE_S)  # after the slow call, on the same thread
        assert ran == [1]  # it completed, unseen by its caller
        assert undone == [1]  # and its undo ran once, after it
    finally:
        release.set()
        loop.stop()


def test_timed_out_call_that_then_fails_is_not_undone(tiny_model_dir: Path) -> None:
    """A started call that ends by raising (e.g. a submit refusing an id a live request
    holds) did nothing: its undo (aborting that id) must not run."""
    loop = StepLoop("test-step", make_engine(tiny_model_dir), lambda outputs: None)
    loop.thread.start()
    release = threading.Event()
    undone: list[int] = []

    def slow_refusal() -> None:
        release.wait(DEADLINE_S)
        raise ValueError("request id 'r' is already active")

    try:
        for timeout in (0.2, 1.0, 5.0):
            try:
                loop.call(slow_refusal, timeout=timeout, undo=lambda: undone.append(1))
            except EngineCallTimeoutError as error:
                if error.started:
                    break
        else:
            pytest.fail("the loop never started the call")
        release.set()
        loop.call(lambda: None, timeout=DEADLINE_S)  # after the refusal and the posted undo
        assert undone == []
    finally:
        release.set()
        loop.stop()


def test_call_whose_function_raises_timeout_error_passes_it_on(tiny_model_dir: Path) -> None:
    loop = StepLoop("test-step", make_engine(tiny_model_dir), lambda outputs: None)
    loop.thread.start()

    def times_out() -> None:
        raise TimeoutError("the function's own")

    try:
        with pytest.raises(TimeoutError, match="the function's own") as info:
            loop.call(times_out, timeout=DEADLINE_S)
        assert not isinstance(info.value, EngineCallTimeoutError)
    finally:
        loop.stop()
