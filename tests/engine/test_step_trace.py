"""The engine's step trace: one record per model step, with the shape the simulator prices
(prefill tokens and attention, decode sequences and KV tokens), and busy-cycle marks."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.engine.engine_helpers import make_engine
from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import SamplingParams
from workers.engine.speculative import SpeculativeConfig
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
        trace = loop.trace_snapshot()
    finally:
        loop.stop()

    records = trace["records"]
    assert "speculative" not in trace  # no drafts, no counters
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


def test_verified_drafts_are_decode_rows(tiny_model_dir: Path) -> None:
    """A speculating step verifies its drafts in the newest token's chunk: the trace counts
    each as one more decode row over its sequence's context (as the simulator prices a
    draft), not as prefill."""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    engine = make_engine(tiny_model_dir, speculative=spec)
    done = threading.Event()

    def on_outputs(outputs: list[RequestOutput]) -> None:
        if not engine.has_unfinished():
            done.set()

    loop = StepLoop("trace-spec-test", engine, on_outputs)
    loop.thread.start()
    try:
        _run(loop, done, [(24, 40)], "s")  # one repeated token: n-gram lookup finds drafts
        trace = loop.trace_snapshot()
    finally:
        loop.stop()

    records = trace["records"]
    drafts = engine.stats.num_draft_tokens
    assert drafts > 0
    # The draft counters travel with the trace: the simulator's acceptance for this run.
    assert trace["speculative"] == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "num_draft_tokens": drafts,
        "num_accepted_tokens_per_pos": engine.stats.num_accepted_tokens_per_pos,
    }
    prefill_tokens = sum(r[3] for r in records)
    prefill_attention = sum(r[4] for r in records)
    assert (prefill_tokens, prefill_attention) == (24, 24 * 25 // 2)
    decode_steps = [r for r in records if r[5]]
    # One sequence: each decode step is its newest token plus the drafts it verified.
    assert sum(r[5] for r in decode_steps) == len(decode_steps) + drafts
    # A row at position p attends to p + 1 positions: at least the context it extends.
    assert all(r[6] >= r[5] * 25 for r in decode_steps)


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
