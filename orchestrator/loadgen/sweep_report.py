"""What ``pdserve bench sweep`` writes: the JSON document (every run, the per-rate medians,
each cluster's goodput rate and their ratio), the printed table (per rate, both clusters side by
side with the disaggregated / colocated ratio) and the PNG (attainment and ITL p99 against rate).

matplotlib is imported only when a plot is asked for, as in `orchestrator.loadgen.report`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from orchestrator.loadgen.goodput import TARGET, Goodput, SweepRun, goodput_ratio, rate_medians
from orchestrator.loadgen.stats import SLOs

CLUSTERS = ("disaggregated", "colocated")

# (metric key, label, scale): a scale of None formats a share as a percentage.
TABLE_ROWS: tuple[tuple[str, str, float | None], ...] = (
    ("slo_attainment", "SLO attainment", None),
    ("ttft_p50_s", "TTFT p50 (ms)", 1e3),
    ("ttft_p99_s", "TTFT p99 (ms)", 1e3),
    ("itl_p50_s", "ITL p50 (ms)", 1e3),
    ("itl_p99_s", "ITL p99 (ms)", 1e3),
    ("tpot_mean_s", "TPOT mean (ms)", 1e3),
    ("tpot_p90_s", "TPOT p90 (ms)", 1e3),
    ("decode_tok_s_per_request", "decode tok/s per request", 1.0),
    ("output_tok_s", "output tok/s", 1.0),
    ("errored", "errored requests", 1.0),
    # Why a cluster fails: the role whose engines stepped all the run is what it ran out of.
    ("busy_prefill", "busy: prefill workers", None),
    ("busy_decode", "busy: decode workers", None),
    ("busy_mixed", "busy: mixed workers", None),
    ("decode_rows_per_step", "decode rows per step", 1.0),
)


def sweep_document(
    header: Mapping[str, Any],
    runs: Sequence[SweepRun],
    goodputs: Mapping[str, Goodput],
    *,
    complete: bool,
) -> dict[str, Any]:
    """``header``: the command, workload, configs...; ``goodputs``: the clusters whose sweep
    ended (a sweep cut short is saved with what it measured, its rates null)."""
    rates: dict[str, float | None] = {
        name: (goodputs[name].rate if name in goodputs else None) for name in CLUSTERS
    }
    x, y = rates["disaggregated"], rates["colocated"]
    ratio: float | None
    reason: str | None
    if x is None or y is None:
        ratio, reason = None, "the sweep did not finish"
    else:
        ratio, reason = goodput_ratio(x, y)
    return {
        **header,
        "complete": complete,
        "runs": [run.to_json() for run in runs],
        "medians": rate_medians(runs),
        "goodput": {name: g.to_json() for name, g in goodputs.items()},
        "goodput_rate": rates,
        "goodput_ratio": ratio,
        "goodput_ratio_reason": reason,
    }


def _cell(value: float | None, scale: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.1%}" if scale is None else f"{value * scale:.4g}"


def format_table(
    runs: Sequence[SweepRun], goodputs: Mapping[str, Goodput], slos: SLOs, num_seeds: int
) -> str:
    medians = {(row["cluster"], row["rate"]): row for row in rate_medians(runs)}
    lines = [f"{'req/s':>8}  {_median_of(num_seeds):<26} {'disagg':>10} {'coloc':>10} {'ratio':>7}"]
    for rate in sorted({rate for _, rate in medians}):
        lines.append("")
        a, b = medians.get(("disaggregated", rate)), medians.get(("colocated", rate))
        probe = any(row is not None and row["probe"] for row in (a, b))
        for i, (key, label, scale) in enumerate(TABLE_ROWS):
            x = None if a is None else a["metrics"][key]
            y = None if b is None else b["metrics"][key]
            ratio = f"{x / y:.3g}" if x is not None and y else "n/a"
            head = f"{rate:>8.4g}" if i == 0 else " " * 8
            if i == 1 and probe:
                head = f"{'(probe)':>8}"
            lines.append(
                f"{head}  {label:<26} {_cell(x, scale):>10} {_cell(y, scale):>10} {ratio:>7}"
            )
    lines.append(
        f"\ngoodput rate: the highest rate with >= {_target(goodputs):.0%} of measured requests "
        f"within TTFT <= {slos.ttft_s:g} s and TPOT <= {slos.tpot_s * 1e3:g} ms "
        f"({_median_of(num_seeds)})"
    )
    for name in CLUSTERS:
        if name in goodputs:
            lines.append(f"  {name:<14} {goodputs[name].describe()}")
    if all(name in goodputs for name in CLUSTERS):
        both, reason = goodput_ratio(goodputs["disaggregated"].rate, goodputs["colocated"].rate)
        value = f"{both:.3g}" if both is not None else f"n/a ({reason})"
        bounds = [name for name in CLUSTERS if goodputs[name].kind == "at_least"]
        if both is not None and bounds:  # a rate that is only a lower bound
            value += f" ({' and '.join(bounds)}: a lower bound, every swept rate passed)"
        lines.append(f"  disaggregated / colocated goodput rate: {value}")
    return "\n".join(lines)


def _median_of(num_seeds: int) -> str:
    return "one seed" if num_seeds == 1 else f"median of {num_seeds} seeds"


def _target(goodputs: Mapping[str, Goodput]) -> float:
    return next((g.target for g in goodputs.values()), TARGET)


def write_sweep_plot(
    path: str | Path, runs: Sequence[SweepRun], goodputs: Mapping[str, Goodput]
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = rate_medians(runs)
    figure, (attained, itl) = plt.subplots(1, 2, figsize=(11, 4))
    marks = []
    for i, name in enumerate(CLUSTERS):
        color = f"C{i}"
        mine = [row for row in rows if row["cluster"] == name]
        for axis, key, scale in ((attained, "slo_attainment", 100.0), (itl, "itl_p99_s", 1e3)):
            points = [
                (r["rate"], value * scale, r["probe"])
                for r in mine
                if (value := r["metrics"][key]) is not None
            ]
            if not points:
                continue
            axis.plot(
                [p[0] for p in points], [p[1] for p in points], marker="o", color=color, label=name
            )
            probes = [(x, y) for x, y, probe in points if probe]
            if probes:  # bisection probes: circled on the line
                axis.scatter(*zip(*probes, strict=True), s=90, facecolors="none", edgecolors=color)
        goodput = goodputs.get(name)
        if goodput is None:
            continue
        at_least = ">= " if goodput.kind == "at_least" else ""
        marks.append(f"{name} goodput {at_least}{goodput.rate:.3g} req/s")
        if goodput.rate > 0:
            for axis in (attained, itl):
                axis.axvline(goodput.rate, color=color, linestyle="--", alpha=0.7)
    target = _target(goodputs)
    attained.axhline(100 * target, color="gray", linestyle=":", label=f"{target:.0%}")
    attained.set(
        title="SLO attainment (median over seeds)",
        xlabel="rate (req/s)",
        ylabel="% of requests",
        ylim=(-2, 102),
    )
    itl.set(title="ITL p99 (median over seeds)", xlabel="rate (req/s)", ylabel="ms")
    for axis in (attained, itl):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    circled = " (circled: bisection probes)" if any(row["probe"] for row in rows) else ""
    figure.suptitle("; ".join(marks) + " (dashed lines)" + circled if marks else "", fontsize=9)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    plt.close(figure)
