"""A bounded record of an engine's recent steps: what each step ran and how long it took.

Why: the cluster simulator prices engine steps with a cost model, and a calibration run on
its own does not reproduce what a step costs inside a serving cluster on shared cores (other
workers stepping, CPU priorities, the messenger's and gRPC threads: bench/history/RESULTS-notebook.md,
"Simulator validation"). `pdserve bench compare` saves every worker's trace with its result,
and `pdserve calibrate --from-trace` fits the step costs to them
(`orchestrator.sim.trace_fit`).

One record per step that ran the model, as a list of numbers (plain data: it crosses Ray and
lands in JSON)::

    [start_s, seconds, after_wait, prefill_tokens, prefill_attention, decode_seqs, decode_kv_tokens]

``start_s`` is the step loop's ``time.perf_counter()`` (only differences within one trace
mean anything); ``seconds`` is the engine step plus the hand-off of its outputs; ``after_wait``
is 1 when the loop went idle (waited for work) since the previous record, so that the time
from one start to the next is a *busy cycle* (the step plus the loop's own work between
steps: messenger polls, calls from other threads) only where it is 0. The shape fields are
those of the simulator's `orchestrator.sim.cost.StepShape`: a chunk that samples and starts at
or after the last prompt position is a decode: its newest token and, when it speculates, the
drafts verified after it, each one decode row (``decode_seqs`` counts rows,
``decode_kv_tokens`` the positions each row attends to, itself included), which is how the
simulator prices a verified draft (one more decode row over its sequence's context); any
other chunk is prefill (``prefill_attention``: the positions its tokens attend to).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.engine.scheduler import ScheduledChunk
    from workers.engine.sequence import Sequence

DEFAULT_CAPACITY = 16384  # records kept (the newest): ~4 MiB, minutes of steps under load

StepShapeCounts = tuple[int, int, int, int]  # prefill tokens, attention, decode seqs, KV tokens


def shape_of(seqs: Seq[Sequence], chunks: Seq[ScheduledChunk]) -> StepShapeCounts:
    prefill_tokens = prefill_attention = decode_seqs = decode_kv = 0
    for seq, chunk in zip(seqs, chunks, strict=True):
        n = chunk.num_tokens
        attention = n * chunk.start + n * (n + 1) // 2  # row i attends to start + i + 1
        if chunk.samples and chunk.start >= seq.num_prompt_tokens - 1:
            decode_seqs += n  # the newest token, then any drafts it verifies
            decode_kv += attention
        else:
            prefill_tokens += n
            prefill_attention += attention
    return prefill_tokens, prefill_attention, decode_seqs, decode_kv


class StepTrace:
    """Appended to by the step loop's thread only; read it on that thread (`snapshot`)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"a step trace holds at least one record, got {capacity}")
        self._records: deque[tuple[float, ...]] = deque(maxlen=capacity)
        self._num_recorded = 0
        self._waited = True  # nothing before the first record: no cycle ends at it

    def mark_wait(self) -> None:
        """The loop is about to wait for work: the next record starts no busy cycle's end."""
        self._waited = True

    def record(self, start: float, seconds: float, shape: StepShapeCounts) -> None:
        self._records.append((start, seconds, float(self._waited), *map(float, shape)))
        self._waited = False
        self._num_recorded += 1

    def snapshot(self) -> dict[str, Any]:
        return {
            "fields": [
                "start_s",
                "seconds",
                "after_wait",
                "prefill_tokens",
                "prefill_attention",
                "decode_seqs",
                "decode_kv_tokens",
            ],
            "num_recorded": self._num_recorded,
            "num_dropped": self._num_recorded - len(self._records),
            "records": [list(r) for r in self._records],
        }
