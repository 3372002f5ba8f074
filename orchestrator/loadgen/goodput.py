"""SLO attainment and the goodput rate of a rate sweep (pure: no cluster, no I/O).

A run's **SLO attainment** is the share of its measured requests (warm-up left out) that met
both the TTFT and the TPOT SLO; a request that errored met neither, so it counts against it.
Each swept rate runs once per seed, and a rate's figures are the median over its seeds.

The **goodput rate** (DistServe's measure) is the highest rate whose median attainment is at
least the target (90%): the highest swept rate that passes, then refined by bisecting between
it and the next swept rate up (which fails, since no higher rate passed), each probe run over
every seed as a swept rate is. No passing rate: 0. Every swept rate passing: the highest, as a
lower bound ("at least"), since nothing above it was tried.
"""

from __future__ import annotations

import statistics
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from orchestrator.loadgen.step_load import LOAD_KEYS

TARGET = 0.9  # DistServe: the rate at which 90% of requests meet both SLOs

Metrics = dict[str, float | None]

# (key, path in a `stats.summarize` summary): what a sweep keeps of each run.
SUMMARY_METRICS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ttft_p50_s", ("ttft_s", "p50")),
    ("ttft_p99_s", ("ttft_s", "p99")),
    ("itl_p50_s", ("itl_s", "p50")),
    ("itl_p99_s", ("itl_s", "p99")),
    ("tpot_mean_s", ("tpot_s", "mean")),
    ("tpot_p90_s", ("tpot_s", "p90")),
    ("decode_tok_s_per_request", ("decode_tokens_per_s_per_request", "mean")),
    ("output_tok_s", ("output_token_throughput",)),
    ("errored", ("errored",)),
)
# A sweep's runs also carry how busy each role's engines were (`step_load.LOAD_KEYS`).
METRIC_KEYS = ("slo_attainment", *(key for key, _ in SUMMARY_METRICS), *LOAD_KEYS)


def attainment(summary: Mapping[str, Any]) -> float:
    """Measured requests meeting both SLOs / measured requests (errored ones included)."""
    measured = int(summary["measured"])
    return int(summary["slo"]["met"]) / measured if measured else 0.0


def run_metrics(summary: Mapping[str, Any]) -> Metrics:
    """The sweep's figures of one run (None where the run measured nothing of that kind)."""
    metrics: Metrics = {"slo_attainment": attainment(summary)}
    for key, path in SUMMARY_METRICS:
        value: Any = summary
        for part in path:
            value = value[part]
        metrics[key] = None if value is None else float(value)
    return metrics


def median_metrics(runs: Sequence[Mapping[str, float | None]]) -> Metrics:
    """Each figure's median over ``runs`` (the seeds of one rate), over the runs that have it:
    a seed whose requests all errored has no TTFT, and leaves the others' median."""
    if not runs:
        raise ValueError("no runs to take a median of")
    out: Metrics = {}
    for key in METRIC_KEYS:
        values = [v for run in runs if (v := run.get(key)) is not None]
        out[key] = float(statistics.median(values)) if values else None
    return out


@dataclass(frozen=True)
class SweepRun:
    """One cluster's run at one rate and seed."""

    cluster: str
    rate: float
    seed: int
    probe: bool  # a bisection probe rather than a swept rate
    metrics: Metrics
    summary: dict[str, Any] = field(default_factory=dict, compare=False)
    wall_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "cluster": self.cluster,
            "rate": self.rate,
            "seed": self.seed,
            "probe": self.probe,
            "wall_s": self.wall_s,
            "metrics": self.metrics,
            "summary": self.summary,
        }


def rate_medians(runs: Sequence[SweepRun]) -> list[dict[str, Any]]:
    """Per cluster (in order of first appearance), per rate (ascending): the median figures
    over that rate's seeds."""
    groups: dict[str, dict[float, list[SweepRun]]] = {}
    for run in runs:
        groups.setdefault(run.cluster, {}).setdefault(run.rate, []).append(run)
    rows = []
    for cluster, by_rate in groups.items():
        for rate in sorted(by_rate):
            seeds = by_rate[rate]
            rows.append(
                {
                    "cluster": cluster,
                    "rate": rate,
                    "probe": all(r.probe for r in seeds),
                    "seeds": [r.seed for r in seeds],
                    "metrics": median_metrics([r.metrics for r in seeds]),
                }
            )
    return rows


def passes(median_attainment: float | None, target: float = TARGET) -> bool:
    return median_attainment is not None and median_attainment >= target


def bracket(
    attainment_by_rate: Mapping[float, float | None], target: float = TARGET
) -> tuple[float | None, float | None]:
    """(the highest passing rate, the lowest rate above it); None for either that is absent."""
    rates = sorted(attainment_by_rate)
    passing = [r for r in rates if passes(attainment_by_rate[r], target)]
    if not passing:
        return None, None
    above = [r for r in rates if r > passing[-1]]  # all fail: none passes above the highest
    return passing[-1], above[0] if above else None


Kind = Literal["none", "at_least", "bracketed"]


@dataclass(frozen=True)
class Goodput:
    rate: float  # 0.0 when no swept rate passed
    kind: Kind
    # The swept bracket: the highest passing rate and the next rate up (both None: no pass;
    # failing None: every rate passed).
    passing: float | None
    failing: float | None
    # After bisection: the lowest rate known to fail above `rate` (None: none known).
    upper: float | None
    probes: tuple[tuple[float, float | None], ...] = ()  # (rate, median attainment), in order
    target: float = TARGET
    attainment: dict[float, float | None] = field(default_factory=dict)  # swept and probed

    def describe(self) -> str:
        if self.kind == "none":
            return f"0 req/s: no swept rate reached {self.target:.0%} attainment"
        if self.kind == "at_least":
            return f"at least {self.rate:.4g} req/s: every swept rate reached {self.target:.0%}"
        count = len(self.probes)
        steps = f", {count} bisection probe{'s' * (count > 1)}" if count else ""
        return (
            f"{self.rate:.4g} req/s (passes; {self.upper:.4g} fails; swept "
            f"{self.passing:.4g} passed, {self.failing:.4g} failed{steps})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "rate": self.rate,
            "kind": self.kind,
            "target": self.target,
            "passing": self.passing,
            "failing": self.failing,
            "upper": self.upper,
            "probes": [{"rate": r, "slo_attainment": a} for r, a in self.probes],
            "description": self.describe(),
        }


# A rate's median attainment over every seed, measured when asked; ``probe``: a bisection
# probe rather than a swept rate.
AttainmentAt = Callable[[float, bool], Awaitable[float | None]]


async def find_goodput(
    rates: Sequence[float],
    bisect_steps: int,
    attainment_at: AttainmentAt,
    target: float = TARGET,
) -> Goodput:
    """Measure every swept rate (in order), then bisect ``bisect_steps`` times between the
    highest passing rate and the next one up. Async because a measurement is a served run."""
    if bisect_steps < 0:
        raise ValueError(f"bisection steps must be >= 0, got {bisect_steps}")
    measured: dict[float, float | None] = {}
    for rate in rates:
        measured[rate] = await attainment_at(rate, False)
    passing, failing = bracket(measured, target)
    if passing is None:
        return Goodput(0.0, "none", None, None, None, (), target, measured)
    if failing is None:
        return Goodput(passing, "at_least", passing, None, None, (), target, measured)
    good, bad = passing, failing
    probes = []
    for _ in range(bisect_steps):
        rate = (good + bad) / 2
        measured[rate] = await attainment_at(rate, True)
        probes.append((rate, measured[rate]))
        if passes(measured[rate], target):
            good = rate
        else:
            bad = rate
    return Goodput(good, "bracketed", passing, failing, bad, tuple(probes), target, measured)


def goodput_ratio(disaggregated: float, colocated: float) -> tuple[float | None, str | None]:
    """disaggregated / colocated goodput rate, or (None, why) when it is undefined."""
    if colocated > 0:
        return disaggregated / colocated, None
    if disaggregated > 0:
        return None, "the colocated cluster has no goodput (no swept rate passed): unbounded ratio"
    return None, "neither cluster has goodput (no swept rate passed)"
