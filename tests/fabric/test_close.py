"""`close` where it cannot wait for the progress thread: called on that thread (an inline
callback), or that thread is stuck in a provider call (NAMED TEST FAULT `harness.StuckPosts`).
The teardown then falls to the progress thread as its work ends, and nothing is left behind."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from tests.fabric.fakes import BindingLog
from tests.fabric.harness import StuckPosts
from tests.waiting import wait_until
from workers.fabric import (
    EngineClosedError,
    FabricError,
    PeerFailedError,
    TransferEngine,
    progress,
    watchdog,
)

pytestmark = pytest.mark.timeout(180)


def test_close_from_an_inline_callback_is_completed_by_the_progress_thread(
    make_engine: Callable[..., TransferEngine], binding_log: BindingLog
) -> None:
    """An inline callback runs on the progress thread, which `close` cannot join: the thread
    completes the teardown itself, so neither the callback thread nor the endpoint is left."""
    target = make_engine()
    engine = make_engine()
    _, descriptor = target.register(np.zeros(4096, dtype=np.uint8))
    handle, _ = engine.register(np.ones(4096, dtype=np.uint8))
    target.expect_imm(7, 1, target.close, inline=True)
    engine.submit_write(handle, 0, engine.add_peer(target.address), descriptor, 0, 64, imm=7)
    wait_until(
        lambda: not any(thread.is_alive() for thread in target.threads),
        what="the target's threads to end",
    )
    assert target.stats().callback_errors == 0
    assert ("engine_close", 0) in binding_log.events  # freed, every fid closed cleanly
    assert target.closed_reason() == "engine is closed"
    target.close()  # nothing left to do


def test_close_that_times_out_in_a_stuck_post_completes_when_the_post_returns(
    make_engine: Callable[..., TransferEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`close(timeout)` while the progress thread is inside a provider call returns; the
    progress thread completes the teardown once its call returns, and the writes it held end
    with `EngineClosedError`."""
    monkeypatch.setattr(watchdog, "_STALL_S", 600.0)  # this case is not the watchdog's
    engine = make_engine()
    stuck = StuckPosts(progress.lib, engine.threads[0])
    monkeypatch.setattr(progress, "lib", stuck)
    handle, descriptor = engine.register(np.zeros(4096, dtype=np.uint8))
    errors: list[FabricError] = []
    stuck.armed.set()
    engine.submit_write(handle, 0, engine.add_peer(engine.address), descriptor, 0, 64,
                        on_error=errors.append)  # fmt: skip
    try:
        assert stuck.entered.wait(30)
        engine.close(timeout=0.05)
        engine.close(timeout=0.05)  # still stuck: returns again, nothing is lost
        assert engine.closed_reason() == "engine is closed"
    finally:
        stuck.release.set()
    wait_until(
        lambda: not any(thread.is_alive() for thread in engine.threads),
        what="the engine's threads to end",
    )
    assert engine._native is None  # released by the progress thread as it ended
    assert len(errors) == 1 and isinstance(errors[0], EngineClosedError)


def test_close_that_times_out_before_the_watchdog_abandons_still_ends_callbacks(
    make_engine: Callable[..., TransferEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same, but the watchdog abandons the loop after `close` gave up waiting: what it fails
    is delivered, then the callback thread ends; the endpoint is left open (abandoned)."""
    monkeypatch.setattr(watchdog, "_STALL_S", 0.3)
    monkeypatch.setattr(watchdog, "_WATCHDOG_PERIOD_S", 0.05)
    engine = make_engine(op_timeout=600.0)
    stuck = StuckPosts(progress.lib, engine.threads[0])
    monkeypatch.setattr(progress, "lib", stuck)
    handle, descriptor = engine.register(np.zeros(4096, dtype=np.uint8))
    errors: list[FabricError] = []
    stuck.armed.set()
    engine.submit_write(handle, 0, engine.add_peer(engine.address), descriptor, 0, 64,
                        on_error=errors.append)  # fmt: skip
    try:
        assert stuck.entered.wait(30)
        engine.close(timeout=0.0)
        wait_until(lambda: not engine.threads[1].is_alive(), what="the callback thread to end")
        assert len(errors) == 1 and isinstance(errors[0], PeerFailedError), errors
    finally:
        stuck.release.set()
    wait_until(lambda: not engine.threads[0].is_alive(), what="the progress thread to end")
    assert engine._native is not None  # abandoned: left open by design
