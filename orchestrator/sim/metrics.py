"""Summaries of a simulation: latency percentiles, per-request decode speed, SLO attainment,
and the prompt work prefix caching saved."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from orchestrator.sim.simulator import RequestRecord, SimResult


@dataclass(frozen=True)
class SLO:
    """Service-level objectives of one request (DistServe: all must hold).

    max_itl_s: optional bound on a request's longest inter-token gap: the output stutter a
    prefill chunk in a mixed step causes (docs/design.md §1), which a mean TPOT hides.
    """

    ttft_s: float
    tpot_s: float
    max_itl_s: float | None = None

    def __post_init__(self) -> None:
        bounds = (self.ttft_s, self.tpot_s, *(() if self.max_itl_s is None else (self.max_itl_s,)))
        # `not (x > 0)` refuses NaN too, which every comparison would let pass.
        if not all(bound > 0 and math.isfinite(bound) for bound in bounds):
            raise ValueError(f"SLOs must be positive finite seconds, got {self}")

    def met_by(self, record: RequestRecord) -> bool:
        stall_ok = self.max_itl_s is None or record.max_itl <= self.max_itl_s
        return record.ttft <= self.ttft_s and record.tpot <= self.tpot_s and stall_ok


@dataclass(frozen=True)
class Summary:
    num_requests: int
    ttft_mean: float
    ttft_p50: float
    ttft_p99: float
    queue_mean: float
    tpot_mean: float
    itl_p50: float
    itl_p99: float
    e2e_mean: float
    tokens_per_s_per_request: float  # mean over requests of 1 / TPOT
    # The slowest tenth of requests decode at most this fast: a mean hides the requests that
    # prefill interruptions slow most, which "consistently above X tok/s" is about.
    tokens_per_s_per_request_p10: float
    output_tokens_per_s: float  # cluster throughput over the measured requests' span
    slo_attainment: float

    def row(self) -> str:
        return (
            f"TTFT mean {self.ttft_mean * 1e3:8.1f} ms  p99 {self.ttft_p99 * 1e3:8.1f} ms | "
            f"TPOT {self.tpot_mean * 1e3:6.1f} ms  ITL p50 {self.itl_p50 * 1e3:6.1f} "
            f"p99 {self.itl_p99 * 1e3:6.1f} ms | {self.tokens_per_s_per_request:6.1f} tok/s/req "
            f"(p10 {self.tokens_per_s_per_request_p10:6.1f}) | "
            f"SLO {self.slo_attainment:5.1%}"
        )


def check_warmup(warmup: float) -> None:
    if not 0 <= warmup < 0.5:
        raise ValueError(f"warmup must be in [0, 0.5), got {warmup}")


def measured(records: tuple[RequestRecord, ...], warmup: float) -> list[RequestRecord]:
    """Requests arriving inside the middle of the run: the first and last ``warmup`` share of
    arrivals see an emptier cluster (filling up, draining) than steady state."""
    check_warmup(warmup)
    cut = int(len(records) * warmup)
    ordered = sorted(records, key=lambda r: r.arrival_time)
    return ordered[cut : len(ordered) - cut] or ordered


def unsettled(result: SimResult, warmup: float) -> tuple[float, float] | None:
    """(seconds of arrivals left out at the start, the measured requests' mean time in the
    cluster) when the first is the shorter: a cluster fills up over about one such time, so
    the measured requests then arrived into one still filling up, and their figures are not
    steady state's (smaller batches, faster decode). None when the run had settled."""
    records = measured(result.records, warmup)
    head = min(r.arrival_time for r in records) - min(r.arrival_time for r in result.records)
    stay = float(np.mean([r.e2e for r in records]))
    return (head, stay) if head < stay else None


OVERLOAD_GROWTH = 0.1  # seconds of TTFT gained per second of arrivals


def overloaded(result: SimResult, warmup: float) -> tuple[float, float] | None:
    """(mean TTFT of the first third of the measured requests, by arrival, and of the last
    third) when TTFT grew through the run: the last third's mean more than twice the first's,
    or growing faster than `OVERLOAD_GROWTH` s a second between the thirds (a queue that
    built up before the measured requests came grows slower than it is long). The rate is
    then above what the layout carries, and every figure of the run depends on its length: a
    longer run, a longer queue. A short run near a layout's limit can show the same from a
    burst of arrivals, which a longer run averages out. None when TTFT holds level, as at any
    rate the cluster keeps up with, or with too few requests to tell (fewer than 10 a third)."""
    records = measured(result.records, warmup)
    third = len(records) // 3
    if third < 10:
        return None
    head, tail = records[:third], records[-third:]
    first = float(np.mean([r.ttft for r in head]))
    last = float(np.mean([r.ttft for r in tail]))
    apart = float(np.mean([r.arrival_time for r in tail]) - np.mean([r.arrival_time for r in head]))
    if last > 2 * first or last - first > OVERLOAD_GROWTH * apart:
        return first, last
    return None


def summarize(result: SimResult, slo: SLO | None = None, warmup: float = 0.0) -> Summary:
    records = measured(result.records, warmup)
    ttft = np.array([r.ttft for r in records])
    tpot = np.array([r.tpot for r in records if r.num_output_tokens > 1])
    speed = 1.0 / tpot[tpot > 0] if len(tpot) else np.array([0.0])
    # The measured requests' own gaps, as the load generator's ITL is built from the tokens of
    # the requests it keeps: steps of the fill-up and drain belong to the cut requests.
    gaps = [r.itl_gaps for r in records if len(r.itl_gaps)]
    durations = np.concatenate(gaps) if gaps else np.zeros(0)
    span = max(r.finish_time for r in records) - min(r.arrival_time for r in records)
    met = sum(slo.met_by(r) for r in records) if slo else len(records)
    return Summary(
        num_requests=len(records),
        ttft_mean=float(ttft.mean()),
        ttft_p50=percentile(ttft, 50),
        ttft_p99=percentile(ttft, 99),
        queue_mean=float(np.mean([r.queue_time for r in records])),
        tpot_mean=float(tpot.mean()) if len(tpot) else 0.0,
        itl_p50=percentile(durations, 50) if len(durations) else 0.0,
        itl_p99=percentile(durations, 99) if len(durations) else 0.0,
        e2e_mean=float(np.mean([r.e2e for r in records])),
        tokens_per_s_per_request=float(speed.mean()),
        tokens_per_s_per_request_p10=percentile(speed, 10),
        output_tokens_per_s=sum(r.num_output_tokens for r in records) / span if span > 0 else 0.0,
        slo_attainment=met / len(records),
    )


@dataclass(frozen=True)
class PromptWork:
    """What prefix caching saved over the measured requests: prompt tokens sent, those found
    cached (not computed), and the bytes of KV pushed to decoders."""

    num_prompt_tokens: int
    num_cached_tokens: int
    transferred_bytes: int

    @property
    def computed_share(self) -> float:
        if not self.num_prompt_tokens:
            return 0.0
        return 1.0 - self.num_cached_tokens / self.num_prompt_tokens

    def row(self) -> str:
        return (
            f"prompt tokens computed {self.computed_share:.0%} of {self.num_prompt_tokens} sent; "
            f"KV pushed {self.transferred_bytes / 2**20:.1f} MiB"
        )


def prompt_work(result: SimResult, warmup: float = 0.0) -> PromptWork:
    records = measured(result.records, warmup)
    return PromptWork(
        sum(r.num_prompt_tokens for r in records),
        sum(r.num_cached_tokens for r in records),
        sum(r.transferred_bytes for r in records),
    )


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float:
    """The ``q``-th percentile as the simulator and the load generator both take it (numpy's
    linear interpolation; `orchestrator.loadgen.stats`), so that ``bench validate`` compares
    like with like."""
    return float(np.percentile(np.asarray(values, dtype=float), q))
