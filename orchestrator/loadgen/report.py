"""The run's JSON result file and its PNG plot (ITL over time; ITL and TTFT CDFs).

matplotlib (the ``bench`` extra) is imported only when a plot is asked for, with the Agg
backend, so that the rest of ``pdserve bench`` needs no display and no matplotlib.
"""

from __future__ import annotations

import itertools
import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orchestrator.loadgen.runner import RunOutcome

SCHEMA_VERSION = 1


def machine_load() -> str:
    """``uptime`` of this host: the figures of a shared machine mean little without it."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_document(
    name: str,
    outcome: RunOutcome,
    summary: dict[str, Any],
    step_traces: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """``step_traces``: the workers' (``bench compare``: see `compare.ClusterRun`)."""
    document = {
        "name": name,
        "backend": outcome.backend,
        "max_concurrency": outcome.max_concurrency,
        "wall_s": outcome.wall_s,
        "summary": summary,
        "requests": [r.to_json() for r in outcome.results],
    }
    if step_traces is not None:
        document["step_traces"] = step_traces
    return document


def write_json(path: str | Path, document: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema_version": SCHEMA_VERSION, **document}, indent=1) + "\n")


def write_plot(path: str | Path, runs: Sequence[tuple[str, RunOutcome]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figure, (over_time, itl_cdf, ttft_cdf) = plt.subplots(1, 3, figsize=(13, 3.8))
    for name, outcome in runs:
        measured = [r for r in outcome.results if r.ok and not r.warmup]
        points = [(arrival, gap) for r in measured for arrival, gap in _gaps_with_times(r.chunks)]
        if points:
            times, gaps = zip(*points, strict=True)
            over_time.scatter(times, np.asarray(gaps) * 1e3, s=2, alpha=0.5, label=name)
        for axis, values in (
            (itl_cdf, [g * 1e3 for r in measured for g in r.itls]),
            (ttft_cdf, [t * 1e3 for r in measured if (t := r.ttft) is not None]),
        ):
            if values:
                ordered = np.sort(values)
                axis.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered), label=name)
    over_time.set(title="ITL over time", xlabel="run time (s)", ylabel="gap (ms)")
    itl_cdf.set(title="ITL CDF", xlabel="ms", ylabel="share of tokens", xscale="log")
    ttft_cdf.set(title="TTFT CDF", xlabel="ms", ylabel="share of requests", xscale="log")
    for axis in (over_time, itl_cdf, ttft_cdf):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    plt.close(figure)


def _gaps_with_times(chunks: Sequence[tuple[float, int]]) -> list[tuple[float, float]]:
    """(arrival, gap) of each token-carrying message after the first (zero gaps not drawn)."""
    arrivals = [arrival for arrival, k in chunks if k]
    return [(b, b - a) for a, b in itertools.pairwise(arrivals)]
