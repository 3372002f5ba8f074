"""DistServe-style planner: which P:D counts and TP sizes give the most goodput per GPU.

For every layout within the GPU budget (prefill and decode instance counts, each role's TP
size; optionally the mixed baseline), the planner finds the highest arrival rate at which at
least ``attainment`` of requests meet both SLOs (TTFT and TPOT), by doubling then bisecting
the rate of the same seeded workload. Goodput per GPU is that rate over the layout's GPUs.

Layouts are ranked by goodput per GPU: GPUs are what a deployment pays for. Priced on one
machine's shared cores (`CostModel.shared_cores`), every layout runs on the same machine, and
an instance more is a process, not a GPU: they are ranked by goodput.

Step settings: each layout is planned with every combination of ``prompt_budgets`` (the prompt
tokens a step of its prefill or mixed instances may take) and ``step_intervals_s`` (the pacing
of its decode or mixed instances' decode-only steps) and keeps the one with the most goodput
(`RoleLimits`): whole-prompt prefill steps and paced decode steps pay where the roles share
cores, and a stall-bound mixed instance wants short chunks, so no one setting serves every
layout. Ties keep the setting listed first.

With ``expert_parallel`` (a MoE model priced by the roofline model), every disaggregated
layout of two decode instances or more is also tried with its decode group as one
expert-parallel domain (`Layout.ep_decode`): a what-if, since pdserve's engine keeps every
expert in each instance, so such a layout can be planned and ranked but not emitted.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from orchestrator.config.cluster import MAX_GROUP_RATIO
from orchestrator.sim.cost import CostModel
from orchestrator.sim.instances import EngineLimits
from orchestrator.sim.metrics import SLO, Summary, overloaded, summarize, unsettled
from orchestrator.sim.options import ServingOptions
from orchestrator.sim.simulator import Layout, UnservableError, simulate
from orchestrator.sim.workload import Arrivals
from workers.log import progress

logger = logging.getLogger(__name__)


SETTLE_RUNS = 4  # runs of one layout at one rate, each longer, until the cluster fills up


@dataclass(frozen=True)
class PlanSpec:
    """What to plan for. ``workload.rate`` is only the search's starting rate (multi-turn:
    conversations started per second). ``options``: the engine and router settings every
    layout is simulated with (speculative decoding, prefix caching, routing)."""

    workload: Arrivals
    slo: SLO
    gpu_budget: int
    tp_choices: tuple[int, ...] = (1, 2, 4, 8)
    include_mixed: bool = True
    attainment: float = 0.9
    limits: EngineLimits = field(default_factory=EngineLimits)
    bisect_steps: int = 6
    warmup: float = 0.1
    # Each run lasts at least this long (more requests at higher rates): a run shorter than
    # a request's life never reaches steady state and flatters the layout.
    min_duration_s: float = 30.0
    options: ServingOptions = field(default_factory=ServingOptions)
    expert_parallel: bool = False  # also each decode group as one expert-parallel domain
    prompt_budgets: tuple[int, ...] = ()
    step_intervals_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for budget in self.prompt_budgets:  # EngineLimits' own rules, before a long search
            replace(self.limits, max_num_batched_tokens=budget)
        for interval in self.step_intervals_s:
            replace(self.limits, min_step_interval_s=interval)
        if self.gpu_budget < 1:
            raise ValueError(f"gpu_budget must be >= 1, got {self.gpu_budget}")
        if not self.tp_choices or min(self.tp_choices) < 1:
            raise ValueError(f"tp_choices must be positive, got {self.tp_choices}")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment must be in (0, 1], got {self.attainment}")
        if not 0 <= self.min_duration_s < math.inf:  # NaN fails too
            # It sizes each run's request list: an infinite one has no size.
            raise ValueError(f"min_duration_s must be finite and >= 0, got {self.min_duration_s}")


@dataclass(frozen=True)
class RoleLimits:
    """A layout's engine limits by role: ``limits`` of its decode or mixed instances,
    ``prefill`` of its prefill instances (unused by a mixed layout)."""

    limits: EngineLimits
    prefill: EngineLimits

    def label(self, layout: Layout) -> str:
        """The searched settings: the prompt budget of the instances that prefill, and the
        decoding instances' pacing."""
        prompting = self.limits if layout.is_mixed else self.prefill
        pace = self.limits.min_step_interval_s
        return f"{prompting.max_num_batched_tokens} tok" + (f", {pace * 1e3:g} ms" if pace else "")


def role_limits(spec: PlanSpec, layout: Layout) -> list[RoleLimits]:
    """Every setting to plan ``layout`` with: each prompt budget on the instances that prefill
    (mixed or prefill; a disaggregated layout's decoders keep ``spec.limits``' budget), times
    each pacing interval on the decoding ones (a prefill step is never paced)."""
    base = spec.limits
    budgets = spec.prompt_budgets or (base.max_num_batched_tokens,)
    intervals = spec.step_intervals_s or (base.min_step_interval_s,)
    settings = []
    for budget in budgets:
        prompting = replace(base, max_num_batched_tokens=budget, min_step_interval_s=0.0)
        for interval in intervals:
            if layout.is_mixed:
                decoding = replace(prompting, min_step_interval_s=interval)
            else:
                decoding = replace(base, min_step_interval_s=interval)
            settings.append(RoleLimits(decoding, prompting))
    return settings


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    goodput: float  # requests/s meeting the SLOs at the attainment target
    summary: Summary | None  # at that rate; None when no rate meets the target
    settings: RoleLimits  # the engine limits it was planned with (its best)

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput / self.layout.num_gpus


def layouts(cost: CostModel, spec: PlanSpec) -> Iterator[Layout]:
    """Every layout within the budget whose TP sizes the model supports and whose P:D ratio
    the cluster config accepts (`orchestrator.config.cluster.MAX_GROUP_RATIO`, either way);
    with ``spec.expert_parallel``, each one of several decode instances a second time, as one
    expert-parallel domain (ValueError when the cost model cannot price that)."""
    budget, sizes = spec.gpu_budget, [tp for tp in spec.tp_choices if cost.supports_tp(tp)]
    if spec.expert_parallel:
        try:
            cost.spread_experts(2)
        except ValueError as error:
            raise ValueError(f"expert parallelism: {error}") from None
    for tp_p in sizes:
        for tp_d in sizes:
            for num_p in range(1, (budget - tp_d) // tp_p + 1):
                for num_d in range(1, (budget - num_p * tp_p) // tp_d + 1):
                    if max(num_p, num_d) > MAX_GROUP_RATIO * min(num_p, num_d):
                        continue
                    yield Layout(
                        num_prefill=num_p, num_decode=num_d, tp_prefill=tp_p, tp_decode=tp_d
                    )
                    if spec.expert_parallel and num_d > 1:
                        yield Layout(
                            num_prefill=num_p,
                            num_decode=num_d,
                            tp_prefill=tp_p,
                            tp_decode=tp_d,
                            ep_decode=num_d,
                        )
    if spec.include_mixed:
        for tp in sizes:
            for num_m in range(1, budget // tp + 1):
                yield Layout(num_mixed=num_m, tp_mixed=tp)


def evaluate(
    cost: CostModel,
    layout: Layout,
    spec: PlanSpec,
    rate: float,
    settings: RoleLimits | None = None,
) -> Summary | None:
    """Summary at ``rate`` with ``settings`` (default: ``spec.limits`` on every instance);
    None when the layout cannot hold a request of the workload.

    A run too short for the cluster to fill up (`metrics.unsettled`) flatters the layout: one
    that meets the SLOs anyway is run again over enough arrivals for the share left out at the
    start to outlast a request's time in the cluster twice (up to `SETTLE_RUNS` runs). So is
    one whose queue grows while its measured requests arrive (`metrics.overloaded`): a longer
    run's queue is longer, until the TTFT SLO fails. One that misses the SLOs stands, as a
    cluster filling up further only does worse."""
    settings = settings or RoleLimits(spec.limits, spec.limits)
    duration = spec.min_duration_s
    for _ in range(SETTLE_RUNS):
        workload = spec.workload.at_rate(rate, duration)
        try:
            result = simulate(
                cost, layout, workload, settings.limits, spec.options, settings.prefill
            )
        except UnservableError:
            return None
        summary = summarize(result, spec.slo, spec.warmup)
        short = unsettled(result, spec.warmup) if spec.warmup > 0 else None
        rising = overloaded(result, spec.warmup)
        if summary.slo_attainment < spec.attainment or (short is None and rising is None):
            break
        duration = max(2 * duration, 2 * short[1] / spec.warmup if short else 0.0)
    return summary


def max_goodput(
    cost: CostModel, layout: Layout, spec: PlanSpec, settings: RoleLimits | None = None
) -> Candidate:
    """The layout's goodput with ``settings`` (default: ``spec.limits`` everywhere)."""
    settings = settings or RoleLimits(spec.limits, spec.limits)

    def meets(rate: float) -> Summary | None:
        summary = evaluate(cost, layout, spec, rate, settings)
        return summary if summary and summary.slo_attainment >= spec.attainment else None

    # Start from the workload's rate per GPU scaled to this layout, so that big and small
    # layouts start near their own answer.
    rate = spec.workload.rate * layout.num_gpus / spec.gpu_budget
    good, bad = 0.0, None
    best: Summary | None = None
    for _ in range(12):  # bracket: double while it meets, halve while it does not
        summary = meets(rate)
        if summary:
            good, best = rate, summary
            if bad is not None:
                break
            rate *= 2
        else:
            bad = rate
            if good:
                break
            rate /= 2
    if not good or bad is None:
        return Candidate(layout, good, best, settings)
    for _ in range(spec.bisect_steps):
        rate = (good + bad) / 2
        summary = meets(rate)
        if summary:
            good, best = rate, summary
        else:
            bad = rate
    return Candidate(layout, good, best, settings)


def plan(cost: CostModel, spec: PlanSpec) -> list[Candidate]:
    """Every layout, best goodput per GPU first, or best goodput on shared cores (ties: fewer
    GPUs, then the label)."""
    best: dict[Layout, Candidate] = {}
    searches = [(layout, s) for layout in layouts(cost, spec) for s in role_limits(spec, layout)]
    # One bar step per layout and setting: each is a search of up to ~18 simulations.
    for layout, settings in progress(searches, desc="planning", unit="search"):
        candidate = max_goodput(cost, layout, spec, settings)
        logger.debug("%s, %s: %.3f req/s", layout.label, settings.label(layout), candidate.goodput)
        if layout not in best or candidate.goodput > best[layout].goodput:
            best[layout] = candidate
    candidates = list(best.values())

    def rank(c: Candidate) -> tuple[float, int, str]:
        measure = c.goodput if cost.shared_cores is not None else c.goodput_per_gpu
        return -measure, c.layout.num_gpus, c.layout.label

    return sorted(candidates, key=rank)


def rival(candidates: list[Candidate]) -> Candidate | None:
    """The best of ``candidates`` (ranked, `plan`) of the other kind than the first: mixed
    against disaggregated, and the other way round; one with a goodput, that the engine runs
    (no expert-parallel what-if). With the first, the pair whose measured sweep checks the
    plan (`pdserve bench sweep` runs a disaggregated config against a mixed one). None when
    there is none."""
    if not candidates:
        return None
    kind = candidates[0].layout.is_mixed
    return next(
        (
            c
            for c in candidates[1:]
            if c.layout.is_mixed != kind and c.goodput > 0 and c.layout.ep_decode == 1
        ),
        None,
    )


def format_table(candidates: list[Candidate], top: int, settings: bool = False) -> str:
    """The ``top`` candidates as a table; ``settings``: with the step settings each kept
    (`RoleLimits.label`), for a plan that searched them."""
    extra = f" {'steps':<16}" if settings else ""
    lines = [
        f"{'#':>2}  {'layout':<22}{extra} {'GPUs':>4} {'goodput':>9} {'/GPU':>8} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT':>7} {'ITL p99':>8} {'tok/s/req':>9}",
    ]
    for rank, c in enumerate(candidates[:top], 1):
        s = c.summary
        cells = (
            f"{s.ttft_p50 * 1e3:7.0f}ms {s.ttft_p99 * 1e3:7.0f}ms {s.tpot_mean * 1e3:5.1f}ms "
            f"{s.itl_p99 * 1e3:6.1f}ms {s.tokens_per_s_per_request:9.1f}"
            if s
            else "   (no rate meets the SLOs)"
        )
        steps = f" {c.settings.label(c.layout):<16}" if settings else ""
        lines.append(
            f"{rank:>2}  {c.layout.label:<22}{steps} {c.layout.num_gpus:>4} {c.goodput:7.3f}/s "
            f"{c.goodput_per_gpu:8.4f} {cells}"
        )
    return "\n".join(lines)
