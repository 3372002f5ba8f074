"""The engine step loop: closing (stop, death), the error hook, waiting when blocked, and calls
that time out (cancelled before they start, or reported as still running), and paced decode
steps."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import pytest

from tests.engine.engine_helpers import GREEDY, make_engine, prompts_of_lengths, run_engine
from tests.waiting import wait_until
from workers.engine.errors import EngineCallTimeoutError, EngineClosedError
from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import SamplingParams
from workers.engine.step_loop import StepLoop

DEADLINE_S = 30.0  # bounds a wait for something that should happen within milliseconds


def test_call_after_stop_raises_at_once(tiny_model_dir: Path) -> None:
    loop = StepLoop("test-step", make_engine(tiny_model_dir), lambda outputs: None)
    loop.thread.start()
    assert loop.call(lambda: 1) == 1
    loop.stop()
    assert not loop.thread.is_alive() and loop.is_closed
    with pytest.raises(EngineClosedError, match="stopped"):
        loop.call(lambda: 2, timeout=DEADLINE_S)


def test_stop_before_start_fails_queued_calls(tiny_model_dir: Path) -> None:
    loop = StepLoop("test-step", make_engine(tiny_model_dir), lambda outputs: None)
    results: list[BaseException] = []

    def call() -> None:
        try:
            loop.call(lambda: 1, timeout=DEADLINE_S)
        except BaseException as error:
            results.append(error)

    caller = threading.Thread(target=call)
    caller.start()
    wait_until(lambda: loop._calls.qsize() == 1, DEADLINE_S, "the call to be queued")
    loop.stop()
    caller.join(DEADLINE_S)
    assert len(results) == 1 and isinstance(results[0], EngineClosedError)


def test_death_closes_the_loop_and_reports_the_error(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    reported: list[BaseException] = []
    loop = StepLoop("test-step", engine, lambda outputs: None, on_error=reported.append)

    def broken_step() -> list[RequestOutput]:
        raise RuntimeError("boom in step")

    engine.step = broken_step  # type: ignore[method-assign]
    loop.thread.start()
    loop.call(lambda: engine.add_request("r", [1, 2, 3], GREEDY))
    loop.thread.join(DEADLINE_S)
    assert not loop.thread.is_alive()
    assert [repr(error) for error in reported] == [repr(RuntimeError("boom in step"))]
    with pytest.raises(EngineClosedError, match="died") as info:
        loop.call(lambda: 1, timeout=DEADLINE_S)
    assert info.value.__cause__ is loop.error is reported[0]


def test_blocked_step_waits_for_a_wake_up_instead_of_spinning(tiny_model_dir: Path) -> None:
    """Prefill role: a request waits for pages held by a prefilled request whose KV is still
    being sent. The loop must sleep on its wake event (not step in a tight loop holding the
    GIL), and run the request once the pages are released."""
    engine = make_engine(tiny_model_dir, role="prefill", num_pages=8, page_size=4)
    first, second = prompts_of_lengths([21, 21], seed=5)  # 5 of the 8 pages each
    engine.add_request("a", first, GREEDY)
    while engine.has_unfinished():
        engine.step()
    engine.add_request("b", second, GREEDY)
    num_steps = [0]
    prefilled = threading.Event()
    real_step = engine.step

    def counted_step() -> list[RequestOutput]:
        num_steps[0] += 1
        return real_step()

    def on_outputs(outputs: list[RequestOutput]) -> None:
        if any(o.request_id == "b" and o.finish_reason == "prefilled" for o in outputs):
            prefilled.set()

    engine.step = counted_step  # type: ignore[method-assign]
    loop = StepLoop("test-step", engine, on_outputs)
    loop.thread.start()
    try:
        wait_until(lambda: loop.num_waits >= 10, DEADLINE_S, "the blocked loop to wait 10 times")
        # Every wait follows at most one step that scheduled nothing.
        assert num_steps[0] <= loop.num_waits + 1
        assert engine.stats.num_steps == 1 and not prefilled.is_set()
        loop.call(lambda: engine.release("a"))
        assert prefilled.wait(DEADLINE_S)
    finally:
        loop.stop()
    assert loop.error is None


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


def test_paced_decode_steps_wait_for_their_interval_and_prompt_steps_do_not(
    tiny_model_dir: Path,
) -> None:
    """``min_step_interval_s``, with the pacing clock held still: once a request only decodes,
    its next step never comes due, and the loop waits (a call still runs) instead of stepping.
    A second request's chunked prompt is computed at once all the same, the first request
    decoding in those steps. When the clock moves on, both finish with the greedy tokens of an
    unpaced engine."""
    prompt_a, prompt_b = prompts_of_lengths([5, 60], seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = run_engine(make_engine(tiny_model_dir), [prompt_a, prompt_b], params)
    engine = make_engine(tiny_model_dir, min_step_interval_s=0.5, max_num_batched_tokens=32)
    frozen = [True]
    later = itertools.count(1)

    def clock() -> float:
        """Held at 0 while frozen; then each read a second after the one before."""
        return 0.0 if frozen[0] else float(next(later))

    tokens: dict[str, list[int]] = {"a": [], "b": []}

    def on_outputs(outputs: list[RequestOutput]) -> None:
        for output in outputs:
            tokens[output.request_id].extend(output.new_token_ids)

    loop = StepLoop("test-step", engine, on_outputs, clock=clock)
    loop.thread.start()

    def still_for_five_waits() -> int:
        """The loop's steps after it waited five more times without running one."""
        steps = loop.call(lambda: engine.stats.num_steps)
        waits = loop.num_waits
        wait_until(lambda: loop.num_waits >= waits + 5, DEADLINE_S, "five paced waits")
        assert loop.call(lambda: engine.stats.num_steps) == steps
        return steps

    try:
        loop.call(lambda: engine.add_request("a", prompt_a, params))
        wait_until(lambda: len(tokens["a"]) == 1, DEADLINE_S, "a's first token")
        assert still_for_five_waits() == 1 and len(tokens["a"]) == 1
        loop.call(lambda: engine.add_request("b", prompt_b, params))
        wait_until(lambda: len(tokens["b"]) == 1, DEADLINE_S, "b's first token")
        # 60 prompt tokens in chunks of 16, 16 and 28 (the budget less a's decode row; all but
        # the last end on a page): three steps, each decoding a as well; then neither has
        # prompt work left, and both wait.
        assert still_for_five_waits() == 4 and len(tokens["a"]) == 4
        frozen[0] = False
        wait_until(lambda: not loop.call(engine.has_unfinished), DEADLINE_S, "both to finish")
    finally:
        loop.stop()
    assert loop.error is None
    assert [tokens["a"], tokens["b"]] == expected
    assert engine.block_manager.num_free_pages == engine.num_pages
