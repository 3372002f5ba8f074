"""Step times by how many other workers were in a step at the same time, from saved step traces.

    python bench/step_overlap.py RESULT.json [RESULT.json ...]

RESULT: a `pdserve bench compare --json` result (its runs keep every worker's step trace). For
each step of each worker, the other workers' steps that overlapped it give the mean number of
busy neighbours over the step, rounded to a half. Printed per run, worker role and kind of step
(``decode``: one decode row and no prompt tokens; ``chunk``: a 240-256-token prompt chunk), the
median step time per neighbour count and its ratio to the median with none: how much a busy
neighbour slows a step on shared cores, against the fair share the simulator assumes
(`orchestrator/sim/shared_cores.py`).
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# (run, role, kind, neighbours) -> step seconds
Groups = dict[tuple[str, str, str, float], list[float]]


def step_kind(prefill_tokens: float, decode_seqs: float) -> str | None:
    """The two shapes compared: one decode row alone, or a full-size prompt chunk."""
    if prefill_tokens == 0 and decode_seqs == 1:
        return "decode"
    if 240 <= prefill_tokens <= 256:
        return "chunk"
    return None


def busy_neighbours(
    spans: Sequence[Sequence[tuple[float, float]]], worker: int, start: float, end: float
) -> float:
    """Mean number of the other workers in a step over [start, end] (``spans``: each worker's
    steps as sorted (start, end) pairs), rounded to a half."""
    overlap = 0.0
    for other, steps in enumerate(spans):
        if other == worker:
            continue
        i = max(0, bisect.bisect_left(steps, (start,)) - 1)
        while i < len(steps) and steps[i][0] < end:
            overlap += max(0.0, min(steps[i][1], end) - max(steps[i][0], start))
            i += 1
    return round(2 * overlap / (end - start)) / 2


def group_steps(run_name: str, traces: Sequence[dict[str, Any]], groups: Groups) -> None:
    usable = [t for t in traces if "records" in t]  # a lost worker's entry has none
    spans = [sorted((r[0], r[0] + r[1]) for r in t["records"]) for t in usable]
    for worker, trace in enumerate(usable):
        field = {name: i for i, name in enumerate(trace["fields"])}
        for record in trace["records"]:
            start, seconds = record[0], record[1]
            kind = step_kind(record[field["prefill_tokens"]], record[field["decode_seqs"]])
            if kind is None or seconds <= 0:
                continue
            busy = busy_neighbours(spans, worker, start, start + seconds)
            groups[(run_name, trace.get("role", "?"), kind, busy)].append(seconds)


def table(groups: Groups, min_steps: int = 20) -> list[str]:
    lines = ["run | role | step | busy neighbours | steps | median ms | x alone"]
    alone: dict[tuple[str, str, str], float] = {}
    for (run, role, kind, busy), seconds in sorted(groups.items()):
        if len(seconds) < min_steps:
            continue
        median = statistics.median(seconds)
        if busy == 0:
            alone[(run, role, kind)] = median
        base = alone.get((run, role, kind))
        ratio = f"{median / base:.2f}" if base else "-"
        lines.append(
            f"{run} | {role} | {kind} | {busy:g} | {len(seconds)} | {median * 1e3:.2f} | {ratio}"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="bench compare --json results")
    args = parser.parse_args()
    groups: Groups = defaultdict(list)
    for path in args.results:
        document = json.loads(path.read_text())
        for run in document.get("runs", []):
            if run.get("step_traces"):
                group_steps(f"{path.name}:{run['name']}", run["step_traces"], groups)
    if not groups:
        parser.error("no step traces in those results")
    print("\n".join(table(groups)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
