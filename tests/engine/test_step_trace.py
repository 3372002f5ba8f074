"""The engine's step trace: one record per model step, with the shape the simulator prices
(prefill tokens and attention, decode sequences and KV tokens), and busy-cycle marks."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.engine.engine_helpers import make_engine
from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import SamplingParams
from workers.engine.step_loop import StepLoop
from workers.engine.step_trace import StepTrace

DEADLINE_S = 60.0


def _run(loop: StepLoop, done: threading.Event, requests: list[tuple[int, int]], tag: str) -> None:
    engine = loop._engine

    def submit() -> None:
        for i, (prompt_len, max_tokens) in enumerate(requests):
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            engine.add_request(f"{tag}{i}", [3 + i] * prompt_len, params)

    done.clear()
    loop.call(submit)
    assert done.wait(DEADLINE_S)


def test_mixed_steps_account_for_every_token_and_mark_busy_cycles(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=32)
    done = threading.Event()

    def on_outputs(outputs: list[RequestOutput]) -> None:
        if not engine.has_unfinished():
            done.set()

    loop = StepLoop("trace-test", engine, on_outputs)
    loop.thread.start()
    try:
        _run(loop, done, [(40, 6), (5, 3)], "a")
        first = loop.call(loop.trace.snapshot)
        _run(loop, done, [(20, 2)], "b")
        trace = loop.call(loop.trace.snapshot)
    finally:
        loop.stop()

    records = trace["records"]
    assert trace["num_recorded"] == len(records) == engine.stats.num_steps
    assert trace["num_dropped"] == 0
    burst = len(first["records"])
    # The loop went idle before each batch of requests, and never within one.
    assert [r[2] for r in records] == [1.0] + [0.0] * (burst - 1) + [1.0] + [0.0] * (
        len(records) - burst - 1
    )
    starts = [r[0] for r in records]
    assert starts == sorted(starts) and all(r[1] > 0 for r in records)

    def totals(rows: list[list[float]]) -> list[float]:
        return [sum(r[k] for r in rows) for k in range(3, 7)]

    # Prefill: every prompt token once; its attention is each position's prefix, however it
    # was chunked. Decode: a token fed at position p attends to p + 1 positions; the first
    # token of each answer comes from its prompt's last chunk.
    def attention(n: int) -> int:
        return n * (n + 1) // 2

    def kv(prompt_len: int, max_tokens: int) -> int:
        return sum(p + 1 for p in range(prompt_len, prompt_len + max_tokens - 1))

    assert totals(first["records"]) == [
        45,
        attention(40) + attention(5),
        (6 - 1) + (3 - 1),
        kv(40, 6) + kv(5, 3),
    ]
    assert totals(records[burst:]) == [20, attention(20), 1, kv(20, 2)]
    # 32-token budget: the 40-token prompt takes two chunks, with decodes of the other.
    assert max(r[3] for r in records) == 32


def test_the_trace_keeps_the_newest_records() -> None:
    trace = StepTrace(capacity=3)
    for i in range(5):
        trace.record(float(i), 0.01, (0, 0, 1, 10 + i))
    snapshot = trace.snapshot()
    assert snapshot["num_recorded"] == 5 and snapshot["num_dropped"] == 2
    assert [r[0] for r in snapshot["records"]] == [2.0, 3.0, 4.0]
    assert [r[2] for r in snapshot["records"]] == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="at least one"):
        StepTrace(capacity=0)
