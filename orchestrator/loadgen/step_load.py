"""How loaded each role's engines were during one run, from the workers' step traces.

A sweep says at which rate a cluster stops meeting its SLOs; this says why: a role whose
workers stepped all the run (busy near 1) is what the cluster ran out of. On the long-prompt
mix of bench/RESULTS.md, where the disaggregated side fails on TTFT, its prefill workers step
for most of the run and its decoder for less than half of it: more prefill capacity, not a
faster decoder, would move it.

Each worker's trace (`workers.engine.step_trace`) holds its recent steps, cumulative over the
cluster's life; `TraceCursor` keeps, per worker, the start of the newest step it has seen, so
the records after it are the ones of the run since the previous look. Start times are each
worker's own clock and are compared within one worker only. A run of more steps than a trace
keeps (16,384) is counted on the newest of them: its busy share reads low.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from typing import Any

from orchestrator.config.sections import GROUP_ROLES as ROLES

Step = tuple[float, float]  # a step's seconds and decode rows
# Keys a run's metrics gain (`load`): the role's mean busy share, and the decode rows of an
# average step that decoded (decode or mixed workers).
LOAD_KEYS = (*(f"busy_{role}" for role in ROLES), "decode_rows_per_step")


class TraceCursor:
    """Per worker, the start time of the newest step already counted."""

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}

    def advance(self, traces: Iterable[Mapping[str, Any]]) -> list[tuple[str, list[Step]]]:
        """(role, steps) of each worker: its steps newer than the last call's (a worker not
        seen before: all of them); a trace without records (a worker lost) is skipped."""
        out = []
        for trace in traces:
            records = trace.get("records")
            if records is None:
                continue
            fields = trace["fields"]
            start, seconds, rows = (fields.index(f) for f in ("start_s", "seconds", "decode_seqs"))
            worker = str(trace["worker_id"])
            last = self._seen.get(worker, float("-inf"))
            new = [(float(r[seconds]), float(r[rows])) for r in records if r[start] > last]
            if records:  # in step order: the newest is the last
                self._seen[worker] = records[-1][start]
            out.append((str(trace["role"]), new))
        return out


def load(steps: list[tuple[str, list[Step]]], wall_s: float) -> dict[str, float | None]:
    """The run's `LOAD_KEYS` from `TraceCursor.advance`'s steps over a run of ``wall_s``: a
    worker's busy share is its steps' summed time over the run's wall time (at most 1); a
    role no worker has is None."""
    if wall_s <= 0:
        raise ValueError(f"a run's wall time must be positive, got {wall_s}")
    busy: dict[str, list[float]] = {role: [] for role in ROLES}
    rows: list[float] = []
    for role, records in steps:
        busy.setdefault(role, []).append(min(1.0, sum(r[0] for r in records) / wall_s))
        rows.extend(r[1] for r in records if r[1] > 0)
    out: dict[str, float | None] = {
        f"busy_{role}": statistics.fmean(busy[role]) if busy[role] else None for role in ROLES
    }
    out["decode_rows_per_step"] = statistics.fmean(rows) if rows else None
    return out
