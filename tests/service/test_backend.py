"""`MixedBackend` with a real engine: closing stops everything it started, and a dying step
loop ends the streams it leaves open."""

from __future__ import annotations

import os
import queue
import signal
from pathlib import Path

import pytest

from workers.engine.config import EngineConfig
from workers.engine.errors import EngineClosedError, TensorParallelError
from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import SamplingParams
from workers.service.backend import MixedBackend
from workers.wire import TokenDelta

DEADLINE_S = 30.0
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


def _final(deltas: queue.SimpleQueue[TokenDelta]) -> TokenDelta:
    while True:
        delta = deltas.get(timeout=DEADLINE_S)
        if delta.finished:
            return delta


@pytest.mark.slow
def test_close_stops_the_tensor_parallel_followers(tiny_model_dir: Path) -> None:
    backend = MixedBackend(tiny_model_dir, EngineConfig(num_pages=32, tensor_parallel_size=2))
    assert backend.engine.tp is not None
    followers = backend.engine.tp.processes
    backend.close()
    for process in followers:
        process.join(DEADLINE_S)
    assert [process.exitcode for process in followers] == [0]  # left on SHUTDOWN
    backend.close()  # idempotent


@pytest.mark.slow
def test_a_follower_dying_while_the_worker_idles_fails_its_health_check(
    tiny_model_dir: Path,
) -> None:
    """`load()` is what the control plane's health check reads: a dead rank must show there,
    not only on the next request (which would fail, with the worker still listed healthy)."""
    backend = MixedBackend(tiny_model_dir, EngineConfig(num_pages=32, tensor_parallel_size=2))
    try:
        assert backend.engine.tp is not None
        assert backend.load().num_total_kv_pages == 32
        (follower,) = backend.engine.tp.processes
        assert follower.pid is not None
        os.kill(follower.pid, signal.SIGKILL)
        follower.join(DEADLINE_S)
        with pytest.raises(TensorParallelError, match="follower died"):
            backend.load()
    finally:
        backend.close()


def test_a_dying_step_loop_ends_open_streams(tiny_model_dir: Path) -> None:
    backend = MixedBackend(tiny_model_dir, EngineConfig(num_pages=32))
    engine = backend.engine
    real_step = engine.step

    def failing_step() -> list[RequestOutput]:
        outputs = real_step()
        if engine.stats.num_sampled_tokens >= 3:
            raise RuntimeError("boom in step")
        return outputs

    engine.step = failing_step  # type: ignore[method-assign]
    deltas: queue.SimpleQueue[TokenDelta] = queue.SimpleQueue()
    try:
        backend.submit("r", [1, 2, 3, 4], LONG, b"", deltas.put)
        final = _final(deltas)
        assert final.finish_reason == "error"
        assert final.error is not None and "boom in step" in final.error
        with pytest.raises(EngineClosedError, match="died"):
            backend.submit("s", [1, 2, 3], LONG, b"", deltas.put)
    finally:
        backend.close()


def test_close_ends_open_streams_and_refuses_new_requests(tiny_model_dir: Path) -> None:
    backend = MixedBackend(tiny_model_dir, EngineConfig(num_pages=32))
    backend.engine.step = list  # type: ignore[method-assign]  # the request stays open
    deltas: queue.SimpleQueue[TokenDelta] = queue.SimpleQueue()
    backend.submit("r", [1, 2, 3, 4], LONG, b"", deltas.put)
    backend.close()
    final = _final(deltas)
    assert (final.finish_reason, final.error) == ("error", "worker closed")
    with pytest.raises(EngineClosedError, match="stopped"):
        backend.submit("s", [1, 2, 3], LONG, b"", deltas.put)
