"""The engine step loop: closing (stop, death), the error hook, and waiting when blocked."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.engine.engine_helpers import GREEDY, make_engine, prompts_of_lengths
from workers.engine.errors import EngineClosedError
from workers.engine.outputs import RequestOutput
from workers.engine.step_loop import StepLoop

DEADLINE_S = 30.0  # bounds a wait for something that should happen within milliseconds


def _wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, "condition never met"
        time.sleep(0.005)


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
    _wait_for(lambda: loop._calls.qsize() == 1)
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
        _wait_for(lambda: loop.num_waits >= 10)
        # Every wait follows at most one step that scheduled nothing.
        assert num_steps[0] <= loop.num_waits + 1
        assert engine.stats.num_steps == 1 and not prefilled.is_set()
        loop.call(lambda: engine.release("a"))
        assert prefilled.wait(DEADLINE_S)
    finally:
        loop.stop()
    assert loop.error is None
