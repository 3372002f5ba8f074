"""The roofline DeepSeek-R1 preset against the reference deployment's result (docs/design.md §1):
mixed serving stayed under ~50 tok/s per request; 1 prefill : 3 decode nodes gave > 90 tok/s
per request at ~1 QPS per decode node, for ~100 ms more TTFT.

Workload (ours; the reference does not give one): Poisson arrivals, prompts uniform in
4096-8192 tokens, outputs uniform in 1024-2048, 300 requests, seed 0; nodes of 8 H200 at TP 8,
8 x 400 Gb/s NICs, the default 2048-token step budget; the first and last 20% of arrivals
left out of the averages. Mixed runs on 4 nodes, as many as 1P:3D, at the same rate per node.

What the model reproduces with its a-priori efficiency factors (bench/history/RESULTS-notebook.md has the
table): the direction everywhere (disaggregated decode is faster per request, with a flat
ITL where mixed steps stall on prefill chunks, for a higher TTFT) and the size at 0.5 QPS
per decode node (> 90 vs the mixed baseline below it). At 1 QPS per decode node with these
output lengths the roofline decoder's batch grows to ~35 and both fall to ~35-45 tok/s:
the reference's > 90 there is *not* reproduced (it would need ~2x faster decode steps than
this roofline gives, e.g. MTP / speculative decoding, which it does not model).

With MTP (k = 1, acceptance 0.85, the low end of the 85-90% DeepSeek reports for R1's
first draft; fixed before the run) at 1 QPS per decode node: 1P:3D rises to ~72 tok/s and
mixed to ~60 (bench/RESULTS.md, "Reference shape"). The direction holds; the size still does
not (> 90 against < 50): a decode step of ~15 sequences with a draft each reads ~60% of the
node's routed experts, ~70% of the step's time, which expert parallelism across nodes, not
modelled, would spread.

With the decode group as one expert-parallel domain (`1x8:3x8:ep3`: the three decoders
spread one copy of the routed experts over their 24 GPUs, dispatch and combine priced from
the NIC preset, which matches DeepEP's published latencies within 15%; nothing else changed)
and MTP as above: 1P:3D decodes at ~130 tok/s per request, > 90 as in the reference, ~2.2x
the mixed nodes (which keep every expert per node, as the reference's data-parallel mixed
deployment: ~60 tok/s with MTP, ~38 without). The size of the split side is reproduced; the
mixed side stays under 50 only without MTP (the reference does not say whether its mixed
deployment drafted).

Read as the reference words it ("struggled to *consistently* exceed 50"; fixed before the runs:
a deployment consistently exceeds X when the slowest tenth of its requests decode faster than
X), the verdict is the same: 1P:3D with expert parallelism keeps p10 > 90, mixed with MTP
keeps p10 > 50 too. Each request sees about the same rate of prefill chunks over its tens of
seconds of decode, so the spread over requests is narrow (p10 0.91-0.96x the mean).

Not reproduced either, and not asserted: at the same hardware *and* the same total load
(4M at 1.5 QPS against 1P:3D at 1.5 QPS) mixed decodes faster per request here (137 vs
112 tok/s), because its fourth node decodes too and a roofline step that mixes a chunk with
decodes reads the weights once for both. The comparison these tests make is at the same
load per decoding node, which is how the reference states its result.
"""

from __future__ import annotations

import pytest

from orchestrator.sim.cost import create_cost_model
from orchestrator.sim.metrics import Summary, summarize
from orchestrator.sim.options import ServingOptions
from orchestrator.sim.simulator import Layout, simulate
from orchestrator.sim.speculative import SpecDecoding
from orchestrator.sim.workload import LengthDist, Workload

DISAGGREGATED = Layout(num_prefill=1, num_decode=3, tp_prefill=8, tp_decode=8)
WIDE_EP = Layout(num_prefill=1, num_decode=3, tp_prefill=8, tp_decode=8, ep_decode=3)
MIXED = Layout(num_mixed=4, tp_mixed=8)


MTP = ServingOptions(SpecDecoding((0.85,), "mtp"))


def _run(layout: Layout, per_node: float, options: ServingOptions | None = None) -> Summary:
    cost = create_cost_model("roofline:deepseek-r1:h200:8x400g")
    nodes = layout.num_decode or layout.num_mixed
    workload = Workload(
        per_node * nodes,
        300,
        LengthDist.parse("uniform:4096-8192"),
        LengthDist.parse("uniform:1024-2048"),
    )
    return summarize(simulate(cost, layout, workload, options=options), warmup=0.2)


@pytest.fixture(scope="module")
def half_qps() -> tuple[Summary, Summary]:
    return _run(DISAGGREGATED, 0.5), _run(MIXED, 0.5)


@pytest.fixture(scope="module")
def one_qps() -> tuple[Summary, Summary]:
    return _run(DISAGGREGATED, 1.0), _run(MIXED, 1.0)


def test_half_qps_per_decode_node_reproduces_direction_and_size(
    half_qps: tuple[Summary, Summary],
) -> None:
    split, mixed = half_qps
    assert split.tokens_per_s_per_request > 90
    assert mixed.tokens_per_s_per_request < split.tokens_per_s_per_request
    # Mixed steps stall on prefill chunks; decode-only steps do not.
    assert mixed.itl_p99 > 3 * mixed.itl_p50 and split.itl_p99 < 2 * split.itl_p50
    # The price: a higher TTFT (the single prefill node's queue, the KV push), tens to
    # hundreds of ms, not seconds.
    assert 0 < split.ttft_mean - mixed.ttft_mean < 0.5


def test_one_qps_per_decode_node_keeps_the_direction_not_the_size(
    one_qps: tuple[Summary, Summary],
) -> None:
    split, mixed = one_qps
    assert mixed.tokens_per_s_per_request < 50  # as the reference's mixed baseline
    assert split.tokens_per_s_per_request > mixed.tokens_per_s_per_request
    # Not > 90 as in the reference (see the module docstring); pinned loosely so that a
    # change of the model that moves it shows up here.
    assert 30 < split.tokens_per_s_per_request < 60
    assert split.ttft_mean > mixed.ttft_mean


@pytest.fixture(scope="module")
def one_qps_mtp() -> tuple[Summary, Summary]:
    return _run(DISAGGREGATED, 1.0, MTP), _run(MIXED, 1.0, MTP)


def test_mtp_at_one_qps_per_decode_node_keeps_the_direction_and_misses_the_size(
    one_qps: tuple[Summary, Summary], one_qps_mtp: tuple[Summary, Summary]
) -> None:
    split, mixed = one_qps_mtp
    # Drafts speed up both, by less than the 1.85 tokens a step they emit.
    for drafted, plain in zip(one_qps_mtp, one_qps, strict=True):
        assert 1.2 * plain.tokens_per_s_per_request < drafted.tokens_per_s_per_request
        assert drafted.tokens_per_s_per_request < 1.85 * plain.tokens_per_s_per_request
    assert split.tokens_per_s_per_request > mixed.tokens_per_s_per_request
    assert mixed.itl_p99 > 2 * split.itl_p99  # mixed steps still stall on prefill chunks
    # Not > 90 against < 50 as in the reference (see the module docstring); pinned loosely.
    assert 60 < split.tokens_per_s_per_request < 90
    assert 50 < mixed.tokens_per_s_per_request < split.tokens_per_s_per_request
    # Nor read as consistency: the mixed nodes' slowest tenth still decodes above 50.
    assert 50 < mixed.tokens_per_s_per_request_p10 < mixed.tokens_per_s_per_request


def test_an_expert_parallel_decode_group_with_mtp_reproduces_the_size(
    one_qps: tuple[Summary, Summary], one_qps_mtp: tuple[Summary, Summary]
) -> None:
    split = _run(WIDE_EP, 1.0, MTP)
    plain_split, plain_mixed = one_qps
    tp_split, mixed = one_qps_mtp
    assert split.tokens_per_s_per_request > 90  # the reference's 1P:3D
    assert split.tokens_per_s_per_request_p10 > 90  # consistently: its slowest tenth too
    assert split.tokens_per_s_per_request > 1.8 * mixed.tokens_per_s_per_request
    assert split.tokens_per_s_per_request > 1.5 * tp_split.tokens_per_s_per_request
    assert plain_mixed.tokens_per_s_per_request < 50 < mixed.tokens_per_s_per_request
    # Decode steps alone, none stalled by a prefill chunk: a flat ITL.
    assert split.itl_p99 < 2 * split.itl_p50 and split.itl_p99 < mixed.itl_p99 / 3
    # The prefill side is the same node: the same TTFT within a decode step or two.
    assert abs(split.ttft_mean - tp_split.ttft_mean) < 0.05
    assert plain_split.tokens_per_s_per_request < 90
