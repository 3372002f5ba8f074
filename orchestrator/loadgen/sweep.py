"""``pdserve bench sweep``: one workload at several rates and seeds on a disaggregated and a
colocated cluster, and each cluster's goodput rate (`orchestrator.loadgen.goodput`).

Each cluster is started once (`compare.serving`) and runs every rate, seed and bisection probe
before it is stopped and the next one starts: a start costs 10-30 s, more than a short run.
Runs on one cluster are independent measurements: each waits for all its requests to finish
before the next begins, and each rate sends prompts of its own (`SweepPlan.options_at`), so
the engines' prefix caches find nothing of an earlier run's prompts; nothing a run sent speeds
up or slows down the next (only the first run sees engines that never stepped: `--warmup`).
After each run the workers' step traces give each role's busy share over the run
(`step_load`): which role the cluster ran out of where it fails.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from orchestrator.config.cluster import ClusterConfig
from orchestrator.loadgen.compare import serving, step_traces
from orchestrator.loadgen.goodput import (
    TARGET,
    Goodput,
    SweepRun,
    find_goodput,
    median_metrics,
    run_metrics,
)
from orchestrator.loadgen.report import machine_load
from orchestrator.loadgen.session import BenchOptions, measure
from orchestrator.loadgen.step_load import TraceCursor, load
from orchestrator.sim.workload import Workload
from workers.log import progress, progress_enabled, progress_shown


@dataclass(frozen=True)
class SweepPlan:
    options: BenchOptions  # its workload's rate and seed are replaced per run
    rates: tuple[float, ...]  # ascending, distinct, positive
    seeds: tuple[int, ...]
    bisect_steps: int = 2
    target: float = TARGET

    def options_at(self, rate: float, seed: int) -> BenchOptions:
        """The run's options (ValueError when its warm-up leaves nothing measured). A seed's
        runs at two rates send different prompts (of the same lengths): the same prompts
        again would be prefilled from the cache; both clusters at one rate send the same."""
        workload = self.options.workload
        assert isinstance(workload, Workload)  # `build_plan` refuses a multi-turn workload
        workload = workload.with_rate(rate).with_seed(seed)
        stream = 1 + round(rate * 1000)  # distinct for rates 0.001 req/s apart
        return dataclasses.replace(self.options, workload=workload, prompt_stream=stream)

    def expected_s(self, rate: float) -> float:
        """A guess at a run's length, for the ETA: its arrivals' span, plus a second."""
        span = (self.options.workload.num_requests - 1) / rate
        if self.options.duration_s is not None:
            span = min(span, self.options.duration_s)
        return span + 1.0

    def max_runs(self) -> int:
        """Per cluster: every swept rate and every probe, once per seed."""
        return (len(self.rates) + self.bisect_steps) * len(self.seeds)


@dataclass
class ClusterSweep:
    name: str
    runs: list[SweepRun]
    goodput: Goodput
    load_before: str
    load_after: str


class SweepProgress:
    """Which cluster, rate and seed runs, and about how long is left (cluster starts not
    counted): a bar on a terminal, else a line on stderr as each run starts."""

    def __init__(self, plan: SweepPlan, clusters: int, stream: TextIO | None = None) -> None:
        self.plan = plan
        self.stream = sys.stderr if stream is None else stream
        self.enabled = progress_enabled()
        self.done = 0
        self.total = plan.max_runs() * clusters
        # The ETA scales what is left by how long runs took against their guess so far.
        swept = sum(plan.expected_s(r) for r in plan.rates)
        probe = swept / len(plan.rates)  # a probe's rate is unknown before it runs
        self.expected_left = (swept + probe * plan.bisect_steps) * len(plan.seeds) * clusters
        self.expected_done = 0.0
        self.wall_done = 0.0
        self.bar = progress(desc="bench sweep", total=self.total, unit="run", leave=True)

    def inner_stream(self) -> TextIO | None:
        """Where a run reports its own requests: nowhere under a bar (one left per run would
        pile up), else stderr (a line every 10 s of a long run)."""
        return None if progress_shown(self.stream) else self.stream

    def start(self, cluster: str, rate: float, seed: int, probe: bool) -> None:
        what = f"{cluster} {rate:.4g} req/s seed {seed}" + (" (probe)" if probe else "")
        if self.bar.disable:
            if self.enabled:
                self.stream.write(
                    f"[bench sweep] {what}: run {self.done + 1} of at most {self.total}"
                    f"{self._eta()}\n"
                )
                self.stream.flush()
        else:
            self.bar.set_postfix_str(what)

    def finish(self, rate: float, wall_s: float) -> None:
        expected = self.plan.expected_s(rate)
        self.done += 1
        self.expected_done += expected
        self.wall_done += wall_s
        self.expected_left = max(0.0, self.expected_left - expected)
        self.bar.update()

    def skip(self, runs: int, expected_s: float) -> None:
        """Probes that will not run (no bracket to bisect)."""
        self.total -= runs
        self.expected_left = max(0.0, self.expected_left - expected_s)
        self.bar.total = self.total
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()

    def _eta(self) -> str:
        if not self.expected_done:
            return ""
        left = self.expected_left * self.wall_done / self.expected_done
        return f", ~{left / 60:.1f} min left" if left >= 60 else f", ~{left:.0f} s left"


async def sweep_cluster(
    name: str,
    config: ClusterConfig,
    plan: SweepPlan,
    *,
    num_cpus: int | None = None,
    tracker: SweepProgress | None = None,
    on_run: Callable[[SweepRun], None] | None = None,
) -> ClusterSweep:
    """Start the cluster, run every swept rate and bisection probe over every seed, stop it.
    ``on_run`` sees each run as it ends (a sweep cut short keeps what it measured)."""
    runs: list[SweepRun] = []
    load_before = machine_load()
    async with serving(name, config, num_cpus) as (app, address, http_url):
        cursor = TraceCursor()  # each run's steps: those after the previous run's
        cursor.advance(await step_traces(app))

        async def attainment_at(rate: float, probe: bool) -> float | None:
            measured = []
            for seed in plan.seeds:
                if tracker is not None:
                    tracker.start(name, rate, seed, probe)
                began = time.perf_counter()
                inner = tracker.inner_stream() if tracker is not None else None
                _, summary = await measure(address, http_url, plan.options_at(rate, seed), inner)
                wall_s = time.perf_counter() - began
                steps = cursor.advance(await step_traces(app))
                metrics = {**run_metrics(summary), **load(steps, wall_s)}
                run = SweepRun(name, rate, seed, probe, metrics, summary, wall_s)
                if tracker is not None:
                    tracker.finish(rate, run.wall_s)
                runs.append(run)
                measured.append(run.metrics)
                if on_run is not None:
                    on_run(run)
            return median_metrics(measured)["slo_attainment"]

        goodput = await find_goodput(plan.rates, plan.bisect_steps, attainment_at, plan.target)
        load_after = machine_load()
    if tracker is not None:
        unused = plan.bisect_steps - len(goodput.probes)
        probe_s = sum(plan.expected_s(r) for r in plan.rates) / len(plan.rates)
        tracker.skip(unused * len(plan.seeds), unused * probe_s * len(plan.seeds))
    return ClusterSweep(name, runs, goodput, load_before, load_after)
