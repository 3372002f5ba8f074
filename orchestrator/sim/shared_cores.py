"""Engine processes that share one machine's cores: each one's share of a core, step by step.

Why: a calibration from step traces (`trace_fit`) measures a served cluster whose workers
share the cores, so its steps' seconds hold that cluster's contention. A layout with fewer
processes per core, or other CPU priorities, steps faster or slower than that: priced as
measured, the planner compared a two-process layout with steps that still paid for a third
process (bench/history/RESULTS-notebook.md, "The planner's pick for each mix, plain pairs").

The model: each worker process computes on one thread (the bench configs' ``threads: 1``)
and, while in a step, wants one core. Linux's fair scheduler gives the processes that want
the CPU time in proportion to their weights (1024 / 1.25^nice), and none more than the one
core it can use, so the spare share of a capped process goes to the others (water-filling).
A step that needs ``w`` core-seconds takes ``w / share`` while its share holds.

`alone_seconds` turns traced busy cycles into core-seconds (the integral of the worker's
share over its cycle, every worker of the run aligned on one clock: ``time.perf_counter`` is
Linux's CLOCK_MONOTONIC, one clock for every process of a machine); `ProcessorSharing` turns
them back into seconds in the simulator, the same integral run forward: every simulated step
in progress runs at its share of a core, re-divided whenever a step starts or ends. (Fixing
a step's share when it starts, `SharedCores.slowdown`, priced a long prefill chunk that began
beside idle workers at a whole core however soon they started steps of their own.)
Left out: the router, the load generator and Ray's own processes, which take their share of
the same cores; the fits' intercepts carry their mean cost.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar


def nice_weight(nice: int) -> float:
    """The fair scheduler's weight of a process at ``nice`` (1024 at 0, about x1.25 a step)."""
    return 1024.0 / 1.25**nice


def core_shares(weights: Sequence[float], cores: float) -> list[float]:
    """Each process's share of a core when processes of these weights all want one."""
    shares = [0.0] * len(weights)
    free = list(range(len(weights)))
    left = float(cores)
    while free:
        total = sum(weights[i] for i in free)
        capped = [i for i in free if left * weights[i] / total >= 1.0]
        if not capped:
            for i in free:
                shares[i] = left * weights[i] / total
            break
        for i in capped:
            shares[i] = 1.0
        left -= len(capped)
        free = [i for i in free if i not in capped]
    return shares


@dataclass(frozen=True)
class SharedCores:
    """``cores`` of one machine shared by the cluster's instances, and each role's ``nice``
    (its groups' CPU priority; 0 for a role not named)."""

    cores: float
    role_nice: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.cores > 0:
            raise ValueError(f"shared cores must be > 0, got {self.cores}")
        if not all(0 <= nice <= 19 for _, nice in self.role_nice):
            raise ValueError(f"nice levels must be in 0..19, got {self.role_nice}")

    def nice(self, role: str) -> int:
        return dict(self.role_nice).get(role, 0)

    def weight(self, role: str) -> float:
        return nice_weight(self.nice(role))

    def shares(self, roles: Sequence[str]) -> list[float]:
        """Each one's share of a core while instances of these roles are all in a step."""
        return core_shares([self.weight(role) for role in roles], self.cores)

    def slowdown(self, role: str, other_roles: Sequence[str]) -> float:
        """Seconds per core-second of a step of ``role`` that starts while instances of
        ``other_roles`` are in a step (its share of a core, inverted)."""
        weights = [self.weight(role), *(self.weight(r) for r in other_roles)]
        return 1.0 / core_shares(weights, self.cores)[0]


@dataclass
class _Step:
    role: str
    start: float
    core_seconds: float  # left to run
    share: float = 0.0
    version: int = 0  # of its end time, new at each re-division (unique in the run)


K = TypeVar("K", bound=Hashable)  # what names a step in progress (the simulator's instance)
# A step in progress's end time as last divided: (its key, version, time).
StepEnd = tuple[K, int, float]


class ProcessorSharing(Generic[K]):
    """The steps in progress on shared cores, each advancing at its share of a core.

    `start` and `end` return the new end times of every step in progress (shares change for
    all of them); an end time whose version is not the step's latest is stale, and `end`
    answers None to it. Between two of those calls the shares hold, so a step's core-seconds
    run down linearly and its end time is exact.
    """

    def __init__(self, cores: SharedCores) -> None:
        self._cores = cores
        self._steps: dict[K, _Step] = {}
        self._now = 0.0
        # One count for every step: a stale end of an instance's last step must not match
        # the version of its next.
        self._versions = itertools.count(1)

    def start(self, key: K, role: str, alone_seconds: float, now: float) -> list[StepEnd[K]]:
        """A step of ``role`` that would take ``alone_seconds`` with the cores to itself."""
        self._advance(now)
        core_seconds = alone_seconds * self._cores.shares([role])[0]
        self._steps[key] = _Step(role, now, core_seconds)
        return self._divide(now)

    def end(self, key: K, version: int, now: float) -> tuple[float, list[StepEnd[K]]] | None:
        """The seconds the step took and the others' new end times; None for a stale end."""
        step = self._steps.get(key)
        if step is None or step.version != version:
            return None
        self._advance(now)
        del self._steps[key]
        return now - step.start, self._divide(now)

    def _advance(self, now: float) -> None:
        for step in self._steps.values():
            step.core_seconds -= step.share * (now - self._now)
        self._now = now

    def _divide(self, now: float) -> list[StepEnd[K]]:
        steps = list(self._steps.items())
        shares = self._cores.shares([step.role for _, step in steps])
        ends = []
        for (key, step), share in zip(steps, shares, strict=True):
            step.share, step.version = share, next(self._versions)
            ends.append((key, step.version, now + max(0.0, step.core_seconds) / share))
        return ends


# One worker's busy cycles: (start, seconds) each, in the trace's order.
Cycles = Sequence[tuple[float, float]]


def alone_seconds(workers: Sequence[tuple[float, Cycles]], cores: float) -> list[list[float]]:
    """Core-seconds of each busy cycle of each ``(weight, cycles)`` worker of one run: the
    integral of the worker's share of a core over the cycle, while the run's other workers
    were in cycles of their own."""
    events: list[tuple[float, int, int, int]] = []  # time, 0 = end first, worker, cycle
    for w, (_, cycles) in enumerate(workers):
        for c, (start, seconds) in enumerate(cycles):
            if seconds > 0:  # an empty cycle got nothing (and must not open without closing)
                events.append((start, 1, w, c))
                events.append((start + seconds, 0, w, c))
    heapq.heapify(events)
    result = [[0.0] * len(cycles) for _, cycles in workers]
    active: dict[int, int] = {}  # worker -> its cycle in progress
    now = events[0][0] if events else 0.0
    while events:
        time, starts, w, c = heapq.heappop(events)
        if active and time > now:
            order = sorted(active)
            shares = core_shares([workers[i][0] for i in order], cores)
            for i, share in zip(order, shares, strict=True):
                result[i][active[i]] += share * (time - now)
        now = time
        if starts:
            active[w] = c
        elif active.get(w) == c:
            del active[w]
    return result
