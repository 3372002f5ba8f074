"""Summary statistics of a run: latency percentiles, per-request decode speed, throughput and
goodput, error counts.

Warm-up requests are left out of every latency and throughput figure but counted in
``sent`` / ``completed`` / ``errored``. Percentiles are numpy's linear interpolation, as the
simulator's (`orchestrator.sim.metrics.percentile`, one function for both). ITL
percentiles pool every measured request's per-token gaps (`RequestResult.itls`). Throughput
and goodput divide by the measured window: from the first measured request's send to the last
measured request's end.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from orchestrator.loadgen.records import RequestResult
from orchestrator.sim.metrics import percentile

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLOs:
    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLOs must be positive, got {self}")

    def met_by(self, result: RequestResult) -> bool:
        ttft, tpot = result.ttft, result.tpot
        return (
            result.ok
            and ttft is not None
            and ttft <= self.ttft_s
            and (tpot is None or tpot <= self.tpot_s)  # one-token answers have no TPOT
        )


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 (None for an empty list: nothing was measured)."""
    if not len(values):
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    array = np.asarray(values, dtype=float)
    out: dict[str, float | None] = {"mean": float(array.mean())}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(array, q)
    return out


def summarize(results: Sequence[RequestResult], slos: SLOs, *, cap_hits: int = 0) -> dict[str, Any]:
    measured = [r for r in results if not r.warmup]
    ok = [r for r in measured if r.ok]
    errors = Counter(r.error for r in results if r.error is not None)
    ttfts = [t for r in ok if (t := r.ttft) is not None]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    speeds = [1.0 / t for t in tpots if t > 0]
    itls = [gap for r in ok for gap in r.itls]
    e2es = [e for r in ok if (e := r.e2e) is not None]
    if ok:
        begin = min(r.sent_s for r in measured)
        end = max(r.finish_s for r in ok if r.finish_s is not None)
        window = end - begin
    else:
        window = 0.0
    output_tokens = sum(r.output_tokens for r in ok)
    good = sum(1 for r in ok if slos.met_by(r))

    def rate(count: float) -> float | None:
        return count / window if window > 0 else None

    return {
        "sent": len(results),
        "completed": sum(1 for r in results if r.ok),
        "errored": sum(errors.values()),
        "errors_by_code": dict(sorted(errors.items())),
        "warmup": len(results) - len(measured),
        "measured": len(measured),
        "measured_completed": len(ok),
        "cap_hits": cap_hits,
        "max_send_lag_s": max((r.sent_s - r.scheduled_s for r in results), default=0.0),
        "window_s": window,
        "ttft_s": distribution(ttfts),
        "itl_s": distribution(itls),
        "tpot_s": distribution(tpots),
        "e2e_s": distribution(e2es),
        "decode_tokens_per_s_per_request": distribution(speeds),
        "request_throughput": rate(len(ok)),
        "output_token_throughput": rate(output_tokens),
        "goodput": rate(good),
        "slo": {"ttft_s": slos.ttft_s, "tpot_s": slos.tpot_s, "met": good},
    }


def format_summary(name: str, summary: dict[str, Any]) -> str:
    def ms(d: dict[str, Any], key: str) -> str:
        value = d[key]
        return "    n/a" if value is None else f"{value * 1e3:7.1f}"

    lines = [
        f"== {name}: {summary['completed']} completed, {summary['errored']} errored of "
        f"{summary['sent']} sent ({summary['warmup']} warm-up); cap hits {summary['cap_hits']}"
        + (f"; errors {summary['errors_by_code']}" if summary["errors_by_code"] else "")
    ]
    lines.append(f"   {'ms':<6} {'mean':>7} {'p50':>7} {'p90':>7} {'p99':>7}")
    for key, label in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("tpot_s", "TPOT"), ("e2e_s", "E2E")):
        d = summary[key]
        lines.append(f"   {label:<6} " + " ".join(ms(d, k) for k in ("mean", "p50", "p90", "p99")))
    speed = summary["decode_tokens_per_s_per_request"]

    def num(value: float | None, fmt: str = "7.2f") -> str:
        return "n/a" if value is None else format(value, fmt)

    lines.append(
        f"   decode tok/s per request: mean {num(speed['mean'], '.1f')}, "
        f"p50 {num(speed['p50'], '.1f')} | throughput {num(summary['request_throughput'])} req/s, "
        f"{num(summary['output_token_throughput'], '.1f')} tok/s | goodput "
        f"{num(summary['goodput'])} req/s (TTFT <= {summary['slo']['ttft_s']} s, "
        f"TPOT <= {summary['slo']['tpot_s'] * 1e3:.0f} ms)"
    )
    return "\n".join(lines)
