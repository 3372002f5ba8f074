"""`groups.*.nice`: a worker process lowers the CPU priority of all its threads, present and
future. Run in a child process, since a process cannot raise its priority back."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from workers.service.actor import lower_cpu_priority

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task"), reason="per-thread nice values are Linux's"
)

CHILD = textwrap.dedent(
    """
    import os, threading
    from workers.service.actor import lower_cpu_priority

    def nices():
        return {os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")}

    stop = threading.Event()
    before = threading.Thread(target=stop.wait)  # a thread that already runs
    before.start()
    lower_cpu_priority(7)
    after = threading.Thread(target=stop.wait)  # one started later inherits
    after.start()
    print(sorted(nices()), flush=True)
    lower_cpu_priority(3)  # never raised back (that would need privileges)
    print(sorted(nices()), flush=True)
    stop.set()
    """
)


def test_every_thread_runs_at_the_nice_value() -> None:
    result = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True
    )
    expected = f"[{max(7, os.getpriority(os.PRIO_PROCESS, 0))}]"  # pytest may run niced
    assert result.stdout.split("\n")[:2] == [expected, expected]


def test_zero_changes_nothing() -> None:
    before = os.getpriority(os.PRIO_PROCESS, 0)
    lower_cpu_priority(0)
    assert os.getpriority(os.PRIO_PROCESS, 0) == before
