"""The roofline DeepSeek-R1 preset against the reference deployment's result (docs/design.md §1):
mixed serving "struggled to consistently exceed ~50 tok/s per request" because of prefill
interruptions of hundreds of milliseconds; 1 prefill : 3 decode nodes gave > 90 tok/s per
request at ~1 QPS per decode node, for ~100 ms more TTFT.

Workload (ours; the reference does not give one): Poisson arrivals, prompts uniform in
4096-8192 tokens, outputs uniform in 1024-2048, seed 0, 300 s of arrivals; nodes of 8 H200 at
TP 8, 8 x 400 Gb/s NICs, the default 2048-token step budget; the first and last 20% of arrivals
left out of the averages. Mixed runs on 4 nodes, as many as 1P:3D, at the same rate per node.
The 60 s left out at the start outlast a request's 15-55 s in the cluster, so the measured
requests see steady state (each run checks it); runs of 300 requests, as before, measured the
mixed nodes while they were still filling up, 3-9 tok/s too fast
(bench/history/RESULTS-notebook.md).

What the model reproduces with its a-priori efficiency factors (the notebook has the tables):
the direction everywhere (disaggregated decode is faster per request, with a flat ITL where
mixed steps stall on prefill chunks, for a higher TTFT) and the size at 0.5 QPS per decode
node (> 90 vs the mixed baseline below it). At 1 QPS per decode node the roofline decoder's
batch grows to ~35 and both fall to ~30-40 tok/s: the reference's > 90 there is *not*
reproduced without drafts.

With MTP (k = 1, acceptance 0.85, the low end of the 85-90% DeepSeek reports for R1's first
draft; fixed before the run) at 1 QPS per decode node: 1P:3D rises to ~72 tok/s and mixed to
~55. Drafts gain a little more than the 1.85 tokens a step they emit: at a fixed arrival
rate, faster decode also leaves fewer sequences in each step. A decode step of ~15 sequences
with a draft each still reads ~60% of the node's routed experts, ~70% of the step's time.

With the decode group as one expert-parallel domain (`1x8:3x8:ep3`: the three decoders
spread one copy of the routed experts over their 24 GPUs, dispatch and combine priced from
the NIC preset, which matches DeepEP's published latencies within 15%; nothing else changed)
and MTP as above: 1P:3D decodes at ~130 tok/s per request, > 90 as in the reference, ~2.4x
the mixed nodes (which keep every expert per node, as the reference's mixed deployment).

"Consistently above X" (fixed before the runs: the slowest tenth of requests decode faster
than X): 1P:3D with expert parallelism keeps p10 > 90. The mixed nodes' slowest tenth sits at
the reference's 50 with the 2048-token budget (p10 50-52, ITL p99 ~70 ms), and below it with
whole-prompt steps (p10 ~46), whose ~190 ms interruptions are the "hundreds of milliseconds"
the reference describes; the mean stays above 50 (~55 and ~50).

Not reproduced either, and not asserted: at the same hardware *and* the same total load
(4M at 1.5 QPS against 1P:3D at 1.5 QPS) mixed decodes faster per request here, because its
fourth node decodes too and a roofline step that mixes a chunk with decodes reads the weights
once for both. The comparison these tests make is at the same load per decoding node, which is
how the reference states its result.

Data-parallel decoders (the reference's third deployment, "about 50" tok/s per request at
1 QPS per rank, 8 ranks a node): 24 ranks of one GPU as one expert-parallel domain, MTP as
above. With this workload's answers (1024-2048 tokens) a rank cannot keep up: 1 QPS asks
~1,540 tokens a second of it, and its 64 sequences decode ~1,400 at the step time of that
batch (~85 ms), so the queue grows through any run (TTFT mean 0.9 s over 300 s of arrivals,
8.9 s over 600). With answers of 768-1280 tokens a rank keeps up and decodes at about 50
(52-55 over seeds 0-2, p10 50-52), while 1P:3D, at an eighth of the load per GPU, decodes at
~170.
"""

from __future__ import annotations

import pytest

from orchestrator.sim.cost import create_cost_model
from orchestrator.sim.instances import EngineLimits
from orchestrator.sim.metrics import Summary, overloaded, summarize, unsettled
from orchestrator.sim.options import ServingOptions
from orchestrator.sim.simulator import Layout, SimResult, simulate
from orchestrator.sim.speculative import SpecDecoding
from orchestrator.sim.workload import LengthDist, Workload

DISAGGREGATED = Layout(num_prefill=1, num_decode=3, tp_prefill=8, tp_decode=8)
WIDE_EP = Layout(num_prefill=1, num_decode=3, tp_prefill=8, tp_decode=8, ep_decode=3)
MIXED = Layout(num_mixed=4, tp_mixed=8)
# 24 ranks of one GPU each, one expert-parallel domain; five prefill nodes keep up with them.
DATA_PARALLEL = Layout(num_prefill=5, num_decode=24, tp_prefill=8, tp_decode=1, ep_decode=24)


MTP = ServingOptions(SpecDecoding((0.85,), "mtp"))
WHOLE_PROMPTS = EngineLimits(max_num_batched_tokens=8192)  # no prompt split over steps
DURATION_S = 300.0  # seconds of arrivals
WARMUP = 0.2


def _simulate(
    layout: Layout,
    per_node: float,
    options: ServingOptions | None = None,
    limits: EngineLimits | None = None,
    output: str = "uniform:1024-2048",
) -> SimResult:
    cost = create_cost_model("roofline:deepseek-r1:h200:8x400g")
    rate = per_node * (layout.num_decode or layout.num_mixed)
    workload = Workload(
        rate,
        round(rate * DURATION_S),
        LengthDist.parse("uniform:4096-8192"),
        LengthDist.parse(output),
    )
    return simulate(cost, layout, workload, limits, options=options)


def _run(
    layout: Layout,
    per_node: float,
    options: ServingOptions | None = None,
    limits: EngineLimits | None = None,
    output: str = "uniform:1024-2048",
) -> Summary:
    result = _simulate(layout, per_node, options, limits, output)
    # The measured requests saw steady state, and one the cluster keeps up with.
    assert unsettled(result, WARMUP) is None and overloaded(result, WARMUP) is None
    return summarize(result, warmup=WARMUP)


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
    assert split.ttft_p50 > mixed.ttft_p50


@pytest.fixture(scope="module")
def one_qps_mtp() -> tuple[Summary, Summary]:
    return _run(DISAGGREGATED, 1.0, MTP), _run(MIXED, 1.0, MTP)


def test_mtp_at_one_qps_per_decode_node_keeps_the_direction_and_misses_the_size(
    one_qps: tuple[Summary, Summary], one_qps_mtp: tuple[Summary, Summary]
) -> None:
    split, mixed = one_qps_mtp
    # Drafts speed up both, by about the 1.85 tokens a step they emit (1.9x here): at the same
    # arrival rate, faster decode also leaves fewer sequences in each step (module docstring).
    for drafted, plain in zip(one_qps_mtp, one_qps, strict=True):
        assert 1.5 * plain.tokens_per_s_per_request < drafted.tokens_per_s_per_request
        assert drafted.tokens_per_s_per_request < 2.5 * plain.tokens_per_s_per_request
    assert split.tokens_per_s_per_request > mixed.tokens_per_s_per_request
    assert mixed.itl_p99 > 2 * split.itl_p99  # mixed steps still stall on prefill chunks
    # Not > 90 against < 50 as in the reference (see the module docstring); pinned loosely.
    assert 60 < split.tokens_per_s_per_request < 90
    assert 50 < mixed.tokens_per_s_per_request < split.tokens_per_s_per_request
    # Read as consistency, the mixed nodes' slowest tenth sits at the reference's 50.
    assert 45 < mixed.tokens_per_s_per_request_p10 < 55


def test_whole_prompt_steps_keep_the_mixed_nodes_slowest_tenth_below_50(
    one_qps_mtp: tuple[Summary, Summary],
) -> None:
    _, chunked = one_qps_mtp
    mixed = _run(MIXED, 1.0, MTP, WHOLE_PROMPTS)
    # The reference's "prefill interruptions of hundreds of milliseconds": a prompt's whole
    # prefill in one step, where the 2048-token budget splits it into ~70 ms stalls.
    assert mixed.itl_p99 > 0.15 > chunked.itl_p99
    # It does not consistently exceed 50: its slowest tenth decodes slower.
    assert mixed.tokens_per_s_per_request_p10 < 50
    assert mixed.tokens_per_s_per_request < chunked.tokens_per_s_per_request


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


def test_data_parallel_decoders_decode_at_about_50_where_a_rank_keeps_up() -> None:
    # The reference's third deployment: "about 50" tok/s per request at 1 QPS per rank. A
    # rank of one GPU holds 64 sequences at most (the engine's default); with answers of
    # 1024-2048 tokens, 1 QPS asks ~1,540 tokens a second of it, more than 64 sequences
    # decode at the step time of that batch (~1,400), and the queue grows without end.
    assert overloaded(_simulate(DATA_PARALLEL, 1.0, MTP), WARMUP) is not None
    # With answers of 768-1280 tokens a rank keeps up, and decodes at about 50.
    dp = _run(DATA_PARALLEL, 1.0, MTP, output="uniform:768-1280")
    assert 45 < dp.tokens_per_s_per_request < 60
    # Slower than 1P:3D's decoders at 1 QPS per node of eight GPUs: eight times the load per
    # GPU, and a dispatch and combine over the NICs for every MoE layer of every step.
    wide = _run(WIDE_EP, 1.0, MTP, output="uniform:768-1280")
    assert dp.tokens_per_s_per_request < wide.tokens_per_s_per_request / 2
