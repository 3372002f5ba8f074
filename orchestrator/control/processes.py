"""Local processes by pid, read from ``/proc`` (Linux): who descends from whom, who is still
running, and ending a set of them.

A process is named by its pid *and* its start time: a pid recorded while a worker ran may
belong to an unrelated process once that worker is gone, and must then not be signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class Proc:
    pid: int
    start_time: int  # clock ticks after boot (/proc/PID/stat field 22)


def _stat(pid: int) -> list[str] | None:
    """Fields 3.. of ``/proc/PID/stat`` (state first), or None when there is no such pid."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces or ")".
    return text.rpartition(")")[2].split()


def identify(pid: int) -> Proc | None:
    """The process ``pid`` now, or None when none runs under it."""
    fields = _stat(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return Proc(pid, int(fields[19]))


def is_running(proc: Proc) -> bool:
    """Whether ``proc`` still runs (a zombie has ended; a reused pid is another process)."""
    return identify(proc.pid) == proc


def descendants(roots: Iterable[int]) -> set[Proc]:
    """Every running process below ``roots`` (not the roots themselves)."""
    parent_of: dict[int, int] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None and fields[0] not in ("Z", "X"):
                parent_of[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = set(roots)
    while frontier:
        below = {pid for pid, parent in parent_of.items() if parent in frontier} - found
        found |= below
        frontier = below
    return {proc for proc in map(identify, found) if proc is not None}


def children(pid: int) -> set[Proc]:
    """The running direct children of ``pid``."""
    out = set()
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None and fields[0] not in ("Z", "X") and int(fields[1]) == pid:
                proc = identify(int(entry.name))
                if proc is not None:
                    out.add(proc)
    return out


def signal_all(procs: Iterable[Proc], signum: int) -> None:
    """Send ``signum`` to each of ``procs`` that still runs."""
    for proc in procs:
        if is_running(proc):
            # Ended meanwhile, or (a pid reused by another user's process) not ours.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(proc.pid, signum)


def end(procs: Iterable[Proc], grace_seconds: float) -> set[Proc]:
    """SIGTERM ``procs``, SIGKILL those still running after ``grace_seconds``. Returns the set of
    those that had to be killed."""
    procs = {proc for proc in procs if is_running(proc)}
    signal_all(procs, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline and any(map(is_running, procs)):
        time.sleep(0.05)
    stubborn = set(filter(is_running, procs))
    signal_all(stubborn, signal.SIGKILL)
    return stubborn
