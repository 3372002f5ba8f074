"""Build an engine on a thread that ends, so its steps own the process's only OpenMP team.

libgomp (the OpenMP runtime of torch's CPU wheels) keeps a team of worker threads for every
thread that has opened a parallel region, alive until that thread exits. Once the teams'
threads outnumber the CPUs, libgomp stops spinning between parallel regions (its *throttled*
spin count) and every region of every team pays a futex wake-up instead. A worker that loads
its model on one thread (packing weights runs parallel regions) and steps on another
(`step_loop.StepLoop`) has two teams. On the 2-vCPU VM of bench/RESULTS.md, batch-4 decode
steps of SmolLM2-135M with two threads took 67-81 ms on the loop thread against 45-52 ms on the
thread that loaded the model, and a lone oneDNN projection 151 us against 61 us
(bench/history/RESULTS-notebook.md, "One OpenMP team per worker").

`build_on_passing_thread` runs the construction on a thread that exits when it is done: its
team goes with it, and the loop thread's team is then the only one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def build_on_passing_thread(build: Callable[[], T], name: str = "engine-build") -> T:
    """``build()`` on a new thread that ends before this returns; its result, or its error
    raised here (with the builder's traceback)."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(build())
        except BaseException as exc:  # re-raised on the caller's thread
            error.append(exc)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
