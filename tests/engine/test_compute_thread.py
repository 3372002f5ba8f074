"""Engines are built on a thread that ends, so the step loop's OpenMP team is the only one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from workers.engine.compute_thread import build_on_passing_thread

ROOT = Path(__file__).resolve().parents[2]


def test_the_result_comes_back_from_a_thread_that_has_ended() -> None:
    seen: list[threading.Thread] = []

    def build() -> str:
        seen.append(threading.current_thread())
        return "engine"

    assert build_on_passing_thread(build) == "engine"
    assert seen[0] is not threading.current_thread()
    assert not seen[0].is_alive()


def test_a_build_error_is_raised_on_the_callers_thread() -> None:
    def build() -> None:
        raise FileNotFoundError("no checkpoint at /nowhere")

    with pytest.raises(FileNotFoundError, match="/nowhere"):
        build_on_passing_thread(build)


def test_the_openmp_team_of_a_load_ends_with_its_thread() -> None:
    """The property the worker relies on: parallel torch work on the passing thread (what a
    model load does) leaves no OpenMP threads behind, while the same work on the calling thread
    does. Counted in a fresh interpreter with two OpenMP threads."""
    script = textwrap.dedent(
        """
        import os, time, torch
        from workers.engine.compute_thread import build_on_passing_thread

        def threads():
            return len(os.listdir("/proc/self/task"))

        def load():
            # Large enough for torch to open a parallel region.
            return float(torch.ones(4_000_000).exp_().sum())

        before = threads()
        build_on_passing_thread(load)
        # The team's threads leave a moment after their master: wait for them, up to a bound.
        deadline = time.monotonic() + 30
        while threads() > before and time.monotonic() < deadline:
            time.sleep(0.01)
        after_passing = threads()
        load()
        after_here = threads()
        print(before, after_passing, after_here)
        """
    )
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout
    before, after_passing, after_here = map(int, out.split())
    assert after_passing == before
    assert after_here > before  # the calling thread's own team stays: what is avoided
