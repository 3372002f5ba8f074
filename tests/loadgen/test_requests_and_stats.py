"""Workload → requests, the latency definitions and the summary math, on hand-made records."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from orchestrator.loadgen.records import RequestResult
from orchestrator.loadgen.requests import build_requests
from orchestrator.loadgen.session import BenchOptions
from orchestrator.loadgen.stats import SLOs, distribution, summarize
from orchestrator.sim.workload import LengthDist, Workload


def _workload(seed: int = 7, rate: float = 4.0) -> Workload:
    return Workload(
        rate=rate,
        num_requests=20,
        prompt=LengthDist.parse("uniform:8-64"),
        output=LengthDist.parse("chat:16:2-200"),
        seed=seed,
    )


def test_requests_are_the_simulators_list_with_exact_prompts() -> None:
    workload = _workload()
    requests = build_requests(workload, 320, excluded_ids=range(256, 320), num_warmup=3)
    specs = workload.requests()
    assert [r.index for r in requests] == [s.request_id for s in specs]
    assert [r.arrival_s for r in requests] == [s.arrival_time for s in specs]
    assert [r.num_prompt_tokens for r in requests] == [s.num_prompt_tokens for s in specs]
    assert [r.max_tokens for r in requests] == [s.num_output_tokens for s in specs]
    assert all(0 <= t < 256 for r in requests for t in r.prompt_token_ids)
    assert [r.warmup for r in requests] == [True] * 3 + [False] * 17
    # Same seed, same everything; another seed, other prompts.
    assert build_requests(workload, 320, excluded_ids=range(256, 320), num_warmup=3) == requests
    other = build_requests(workload.with_seed(8), 320)
    assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in requests]
    # Another prompt stream: the same requests with other prompts; stream 0 is the default.
    assert build_requests(workload, 320, excluded_ids=range(256, 320), num_warmup=3,
                          prompt_stream=0) == requests  # fmt: skip
    streamed = build_requests(workload, 320, excluded_ids=range(256, 320), num_warmup=3,
                              prompt_stream=2)  # fmt: skip
    assert [(r.arrival_s, r.num_prompt_tokens, r.max_tokens) for r in streamed] == [
        (r.arrival_s, r.num_prompt_tokens, r.max_tokens) for r in requests
    ]
    pairs = zip(streamed, requests, strict=True)
    assert all(a.prompt_token_ids != b.prompt_token_ids for a, b in pairs)


def test_a_prefix_hit_is_sent_as_one_prefix_common_to_every_prompt() -> None:
    plain = _workload()
    shared = dataclasses.replace(plain, prefix_hit=0.5)
    requests = build_requests(shared, 320, excluded_ids=range(256, 320))
    specs = shared.requests()
    common = max(specs, key=lambda s: s.num_common_tokens)
    head = requests[common.request_id].prompt_token_ids[: common.num_common_tokens]
    for request, spec in zip(requests, specs, strict=True):
        assert spec.num_common_tokens == int(0.5 * spec.num_prompt_tokens)
        assert request.prompt_token_ids[: spec.num_common_tokens] == head[: spec.num_common_tokens]
        assert all(0 <= t < 256 for t in request.prompt_token_ids)
    # The rest of each prompt is the one it has without the prefix; the lengths are the same.
    alone = build_requests(plain, 320, excluded_ids=range(256, 320))
    for with_prefix, without in zip(requests, alone, strict=True):
        n = int(0.5 * with_prefix.num_prompt_tokens)
        assert with_prefix.prompt_token_ids[n:] == without.prompt_token_ids[n:]
        assert with_prefix.num_prompt_tokens == without.num_prompt_tokens
    # Another prompt stream shares another prefix: runs against one cluster stay apart.
    other = build_requests(shared, 320, excluded_ids=range(256, 320), prompt_stream=2)
    assert other[common.request_id].prompt_token_ids[: common.num_common_tokens] != head


def test_duration_drops_late_arrivals_and_bad_bounds_are_rejected() -> None:
    workload = _workload(rate=2.0)
    cut = build_requests(workload, 100, duration_s=3.0)
    assert cut and all(r.arrival_s <= 3.0 for r in cut)
    assert len(cut) < workload.num_requests
    assert cut == build_requests(workload, 100)[: len(cut)]
    with pytest.raises(ValueError, match="warm-up"):
        build_requests(workload, 100, num_warmup=20)
    with pytest.raises(ValueError, match="duration"):
        build_requests(workload, 100, duration_s=0)
    with pytest.raises(ValueError, match="no token ids"):
        build_requests(workload, 3, excluded_ids=(0, 1, 2))


def _kept(workload: Any, duration_s: float) -> int:
    return sum(1 for spec in workload.requests() if spec.arrival_time <= duration_s)


def test_the_warmup_must_leave_a_request_the_duration_keeps() -> None:
    workload = _workload(rate=2.0)
    kept = _kept(workload, 3.0)
    assert 1 < kept < workload.num_requests
    with pytest.raises(ValueError, match=rf"warm-up must be in \[0, {kept}\)"):
        build_requests(workload, 100, num_warmup=kept, duration_s=3.0)
    with pytest.raises(ValueError, match="warm-up"):
        BenchOptions(workload, SLOs(1.0, 1.0), num_warmup=kept, duration_s=3.0)
    requests = build_requests(workload, 100, num_warmup=kept - 1, duration_s=3.0)
    assert [r.warmup for r in requests] == [True] * (kept - 1) + [False]


def _result(
    index: int, chunks: list[tuple[float, int]], sent: float = 0.0, **kw: object
) -> RequestResult:
    result = RequestResult(
        index=index, warmup=False, scheduled_s=sent, prompt_tokens=8, max_tokens=8, sent_s=sent
    )
    result.chunks = list(chunks)
    result.finish_s = chunks[-1][0] if chunks else None
    for key, value in kw.items():
        setattr(result, key, value)
    return result


def test_a_multi_token_message_is_one_gap_and_zero_gaps() -> None:
    # Tokens: 1 at 1.0; 3 at 1.5; a token-less message at 2.0; 1 at 2.5; stream ends 2.6.
    result = _result(0, [(1.0, 1), (1.5, 3), (2.0, 0), (2.5, 1)], sent=0.5)
    result.finish_s = 2.6
    assert result.ttft == pytest.approx(0.5)
    assert result.output_tokens == 5
    assert result.itls == pytest.approx([0.5, 0.0, 0.0, 1.0])
    assert result.tpot == pytest.approx((2.1 - 0.5) / 4)
    # The first message's extra tokens are zero gaps too: one gap per token after the first.
    first = _result(1, [(1.0, 2), (1.2, 1)])
    assert first.itls == pytest.approx([0.0, 0.2])
    assert len(first.itls) == first.output_tokens - 1


def test_distribution_matches_numpy_and_is_empty_safe() -> None:
    values = [0.1, 0.4, 0.2, 0.9, 0.3]
    d = distribution(values)
    assert d["mean"] == pytest.approx(np.mean(values))
    for q in (50, 90, 99):
        assert d[f"p{q}"] == pytest.approx(np.percentile(values, q))
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_summary_counts_every_request_and_goodput_follows_the_slos() -> None:
    # Two fast requests, one with a slow first token, one slow decoder, two errors, one warm-up.
    fast_a = _result(1, [(1.1, 1), (1.2, 1), (1.3, 1)], sent=1.0)  # TTFT .1, TPOT .1
    fast_b = _result(2, [(2.2, 1), (2.3, 2)], sent=2.0)  # TTFT .2, TPOT .05
    slow_first = _result(3, [(5.0, 1), (5.1, 1)], sent=2.0)  # TTFT 3.0
    slow_decode = _result(4, [(3.1, 1), (4.1, 1), (5.1, 1)], sent=3.0)  # TPOT 1.0
    failed = _result(5, [], sent=3.5, error="RESOURCE_EXHAUSTED")
    failed_again = _result(6, [(4.0, 1)], sent=3.6, error="HTTP 503")
    failed_again.finish_s = None
    warm = _result(0, [(0.5, 1), (9.0, 1)], sent=0.0, warmup=True)
    results = [warm, fast_a, fast_b, slow_first, slow_decode, failed, failed_again]
    summary = summarize(results, SLOs(ttft_s=1.0, tpot_s=0.2), cap_hits=2)

    assert summary["sent"] == 7
    assert summary["completed"] + summary["errored"] == summary["sent"]
    assert summary["completed"] == 5 and summary["errored"] == 2
    assert summary["errors_by_code"] == {"HTTP 503": 1, "RESOURCE_EXHAUSTED": 1}
    assert summary["warmup"] == 1 and summary["measured_completed"] == 4
    assert summary["cap_hits"] == 2
    # Window: first measured send (1.0) to last measured end (5.1).
    assert summary["window_s"] == pytest.approx(4.1)
    assert summary["slo"]["met"] == 2  # fast_a and fast_b
    assert summary["goodput"] == pytest.approx(2 / 4.1)
    assert summary["request_throughput"] == pytest.approx(4 / 4.1)
    assert summary["output_token_throughput"] == pytest.approx((3 + 3 + 2 + 3) / 4.1)
    ttfts = [0.1, 0.2, 3.0, 0.1]
    assert summary["ttft_s"]["p50"] == pytest.approx(np.percentile(ttfts, 50))
    itls = [0.1, 0.1, 0.1, 0.0, 0.1, 1.0, 1.0]
    assert summary["itl_s"]["p99"] == pytest.approx(np.percentile(itls, 99))
    assert summary["itl_s"]["mean"] == pytest.approx(np.mean(itls))
    tpots = [0.1, 0.05, 0.1, 1.0]
    speeds = summary["decode_tokens_per_s_per_request"]
    assert speeds["mean"] == pytest.approx(np.mean([1 / t for t in tpots]))


def test_slos_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        SLOs(0.0, 0.1)
