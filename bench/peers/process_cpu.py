"""Where a server's CPU goes during a run: CPU seconds of each of its processes, by name.

A server under test is a tree of processes (``pdserve serve``: the driver, Ray's GCS, raylet and
helpers, one actor process per worker; ``vllm serve``: its API server and engine core).
`TreeSampler` reads it every half second while a client runs; the difference over the client's
measured span says how many cores each kind of process took while the load ran (not while the
client started): the workers' share against what the router, the HTTP front and Ray's own
processes take on the same cores. Linux only (``/proc``); processes that end between two reads
are not counted.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid_dir: Path) -> tuple[str, int, int, float] | None:
    """(name, parent pid, session id, CPU seconds) of one process; None when it is gone."""
    try:
        text = (pid_dir / "stat").read_text()
    except OSError:
        return None
    # The name is in parentheses and may itself hold spaces or parentheses.
    name = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()
    # proc(5): state, ppid, pgrp, session, ..., utime (14th field), stime (15th).
    ppid, session = int(fields[1]), int(fields[3])
    seconds = (int(fields[11]) + int(fields[12])) / _TICKS_PER_S
    return name, ppid, session, seconds


def tree_cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds used so far by ``root``, its descendants and the rest of its session (a
    server started in a session of its own), summed by process name (``comm``: Ray names an
    actor's process ``ray::ClassName``)."""
    processes: dict[int, tuple[str, int, int, float]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(entry)) is not None:
            processes[int(entry.name)] = stat
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _, _) in processes.items():
        children.setdefault(ppid, []).append(pid)
    members = {pid for pid, (_, _, session, _) in processes.items() if session == root}
    members.add(root)
    stack = list(members)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in members:
                members.add(child)
                stack.append(child)
    totals: dict[str, float] = {}
    for pid in members:
        if pid in processes:
            name, _, _, seconds = processes[pid]
            totals[name] = totals.get(name, 0.0) + seconds
    return totals


def cores_used(
    before: Mapping[str, float], after: Mapping[str, float], wall_s: float
) -> dict[str, float]:
    """Cores each process name took between two reads ``wall_s`` apart, largest first; names
    under 0.005 cores are left out."""
    if wall_s <= 0:
        raise ValueError(f"wall_s must be positive, got {wall_s}")
    used = {name: (after[name] - before.get(name, 0.0)) / wall_s for name in after}
    return {
        name: round(cores, 3)
        for name, cores in sorted(used.items(), key=lambda item: -item[1])
        if cores >= 0.005
    }


def format_cores(cores: Mapping[str, float], top: int = 4) -> str:
    """The ``top`` largest shares, e.g. ``ray::PdWorker 1.62, raylet 0.04``."""
    return ", ".join(f"{name} {share:.2f}" for name, share in list(cores.items())[:top])


class TreeSampler:
    """``with TreeSampler(pid) as sampler: run_client()``, then ``sampler.cores_over(span_s)``:
    the cores each process name took over the last ``span_s`` seconds of the block."""

    def __init__(self, root: int, period_s: float = 0.5) -> None:
        self._root = root
        self._period_s = period_s
        self._samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def _sample(self) -> None:
        self._samples.append((time.monotonic(), tree_cpu_seconds(self._root)))

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            self._sample()

    def __enter__(self) -> TreeSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def cores_over(self, span_s: float) -> dict[str, float]:
        """From the last sample at least ``span_s`` before the end (the first one if none) to
        the end."""
        end_s, end = self._samples[-1]
        start_s, start = next(
            (s for s in reversed(self._samples) if s[0] <= end_s - span_s), self._samples[0]
        )
        return cores_used(start, end, end_s - start_s)
