"""The simulator's predictions for a measured run: the same request list (same workload, seed,
duration cut and warm-up) through `orchestrator.sim.simulator` with a cost model, and the
relative error of TTFT p50, ITL p99 and output-token throughput against the measurement.

The layout and per-instance limits come from the cluster config the run served: prefill and
decode replicas (or mixed replicas), and each group's own ``max_num_seqs`` /
``max_num_batched_tokens`` and KV pool (``num_pages`` or ``kv_memory_bytes``, per rank; the
engine's default pool when neither is given), not the calibration engine's pool. The
simulator's ITL is the gaps between the kept requests' tokens (one engine step each, warm-up
requests left out as in the measurement); its TTFT ends when the first token is sampled, plus
the cost model's fixed
per-request overhead (router, gRPC, client, KV admission: `orchestrator.loadgen.overheads`
derives it from a measured run; 0 when the calibration has none).

The engine settings come from the config too (`serving_options`): prefix caching as each
group's engine runs it, the router's policy, and a decode (or mixed) group's speculative
decoding with the acceptance the run had, summed from its workers' draft counters (saved with
their step traces: `acceptance_of`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from orchestrator.config.cluster import ClusterConfig
from orchestrator.sim.cost import CostModel
from orchestrator.sim.instances import EngineLimits
from orchestrator.sim.options import RoutingName, ServingOptions
from orchestrator.sim.simulator import Layout, SimResult, Simulator
from orchestrator.sim.speculative import SPEC_METHODS, SpecDecoding
from orchestrator.sim.workload import RequestSpec
from workers.engine.config import DEFAULT_KV_MEMORY_BYTES

# Figures compared, as (prediction key, path in the load generator's summary).
COMPARED = (
    ("ttft_p50_s", ("ttft_s", "p50")),
    ("itl_p99_s", ("itl_s", "p99")),
    ("output_token_throughput", ("output_token_throughput",)),
)
TOLERANCE = 0.15  # the bar: within 15% of measured


def layout_of(config: ClusterConfig) -> Layout:
    if config.is_disaggregated:
        prefill, decode = config.group("prefill"), config.group("decode")
        return Layout(
            num_prefill=prefill.replicas,
            num_decode=decode.replicas,
            tp_prefill=prefill.tp,
            tp_decode=decode.tp,
        )
    mixed = config.group("mixed")
    return Layout(num_mixed=mixed.replicas, tp_mixed=mixed.tp)


def limits_of(config: ClusterConfig, role: str, cost: CostModel) -> EngineLimits:
    """The ``role`` group's batch shape and KV pool as the simulator's per-instance limits.

    Every rank of a TP instance holds its share of the KV heads for the same pages, so the
    instance holds ``num_pages * page_size`` tokens; a ``kv_memory_bytes`` pool is priced at
    the cost model's bytes per token (its dtype) over ``tp`` ranks."""
    group = config.group(role)
    limits = group.limits
    num_pages = limits.num_pages
    if num_pages is None:
        pool = limits.kv_memory_bytes or DEFAULT_KV_MEMORY_BYTES
        rank_page_bytes = cost.kv_bytes(config.page_size) / group.tp
        num_pages = int(pool // rank_page_bytes)
        if num_pages < 1:
            raise ValueError(
                f"groups.{role}: a KV pool of {pool} bytes holds no page of "
                f"{rank_page_bytes:.0f} bytes per rank ({cost.name})"
            )
    return EngineLimits(
        limits.max_num_seqs,
        limits.max_num_batched_tokens,
        num_pages * config.page_size,
        config.page_size,
        limits.min_step_interval_ms / 1000,
    )


def acceptance_of(step_traces: Sequence[dict[str, Any]]) -> tuple[float, ...] | None:
    """The conditional acceptance per draft position that the decode (or mixed) workers of a
    run had, from the draft counters their step traces carry (summed over workers); None
    when none speculated."""
    from orchestrator.sim.spec_profile import acceptance_from_counters

    counters = [
        trace["speculative"]
        for trace in step_traces
        if trace.get("role") in ("decode", "mixed") and "speculative" in trace
    ]
    if not counters:
        return None
    k = max(int(c["num_speculative_tokens"]) for c in counters)
    kept = [0.0] * k
    for c in counters:
        for position, count in enumerate(c["num_accepted_tokens_per_pos"][:k]):
            kept[position] += float(count)
    drafts = sum(float(c["num_draft_tokens"]) for c in counters)
    return acceptance_from_counters(drafts, kept, k)


def serving_options(
    config: ClusterConfig, acceptance: Sequence[float] | None = None
) -> ServingOptions:
    """What the served cluster's engines and router did beyond their limits, as the
    simulator's options: the decode (or mixed) group's speculative decoding with
    ``acceptance`` (its measured profile), prefix caching as that group's engines run it, the
    router's policy and weights."""
    role = "decode" if config.is_disaggregated else "mixed"
    group = config.group(role)
    speculative = None
    if group.speculative is not None:
        method = group.speculative.method
        if method not in SPEC_METHODS:
            raise ValueError(
                f"groups.{role} drafts with {method}: the simulator models {list(SPEC_METHODS)}"
            )
        k = group.speculative.num_speculative_tokens
        if acceptance is None:
            raise ValueError(
                f"groups.{role} speculates: the run's acceptance is needed (its workers' step "
                "traces carry their draft counters; rerun the compare that saved none)"
            )
        if len(acceptance) < k:
            raise ValueError(f"an acceptance of {len(acceptance)} draft positions, not {k}")
        speculative = SpecDecoding(tuple(acceptance[:k]), method=method)
    router = config.router
    # The simulator balances load one way: round_robin and random spread it evenly too.
    routing: RoutingName = "kv_aware" if router.policy == "kv_aware" else "least_outstanding"
    return ServingOptions(
        speculative=speculative,
        prefix_caching=bool(config.engine_config(role).enable_prefix_caching),
        routing=routing,
        kv_cache_weight=router.kv_cache_weight,
        kv_load_weight=router.kv_load_weight,
    )


def simulator_for(
    cost: CostModel,
    config: ClusterConfig,
    seed: int = 0,
    options: ServingOptions | None = None,
) -> Simulator:
    """A simulator of the served cluster: its layout and each group's limits and KV pool;
    ``seed``: of the cost model's step-time noise, if it has any; ``options``: the engine and
    router settings (`serving_options`; a cluster without drafts when None)."""
    layout = layout_of(config)
    if config.is_disaggregated:
        return Simulator(
            cost,
            layout,
            limits_of(config, "decode", cost),
            prefill_limits=limits_of(config, "prefill", cost),
            seed=seed,
            options=options,
        )
    return Simulator(cost, layout, limits_of(config, "mixed", cost), seed=seed, options=options)


def predict(
    cost: str | CostModel,
    config: ClusterConfig,
    specs: list[RequestSpec],
    num_warmup: int,
    seeds: Sequence[int] = (0,),
    acceptance: Sequence[float] | None = None,
) -> dict[str, float]:
    """``cost``: a model, or its spec (``calibrated:PATH``). ``seeds``: of the step-time noise
    (a model with a spread); with several, each figure is the median of one run per seed, as
    a measured figure is compared as the median of repeats. ``acceptance``: the measured
    profile, for a config that speculates (`serving_options`)."""
    if isinstance(cost, str):
        from orchestrator.sim.cost import create_cost_model

        cost = create_cost_model(cost)
    if not seeds:
        raise ValueError("predict needs at least one noise seed")
    options = serving_options(config, acceptance)
    runs = [_predict_once(cost, config, specs, num_warmup, seed, options) for seed in seeds]
    return {key: float(np.median([run[key] for run in runs])) for key in runs[0]}


def _predict_once(
    cost: CostModel,
    config: ClusterConfig,
    specs: list[RequestSpec],
    num_warmup: int,
    seed: int,
    options: ServingOptions,
) -> dict[str, float]:
    from orchestrator.sim.metrics import summarize

    result = simulator_for(cost, config, seed, options).run(specs)
    measured = tuple(r for r in result.records if r.request_id >= num_warmup)
    # Warm-up requests are left out as in the measurement, their tokens' gaps with them: the
    # ITL percentiles pool the kept records' gaps (`metrics.summarize`).
    kept = SimResult(result.layout, measured, result.itl_steps, result.busy_seconds)
    summary = summarize(kept)
    return {
        "ttft_p50_s": summary.ttft_p50,
        "itl_p99_s": summary.itl_p99,
        "output_token_throughput": summary.output_tokens_per_s,
    }


def compare_to_measured(prediction: dict[str, float], summary: dict[str, Any]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for key, path in COMPARED:
        value = _figure(summary, path)
        predicted = prediction[key]
        error = (predicted - value) / value if value else None
        rows[key] = {
            "predicted": predicted,
            "measured": value,
            "error": error,
            "within_tolerance": error is not None and abs(error) <= TOLERANCE,
        }
    return rows


def median_of(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """The compared figures of several runs' summaries, each the median over the runs (in the
    summaries' own layout, for `compare_to_measured`): repeats of one workload vary from run to
    run on a shared machine, and their median is the steadier thing to predict."""
    median: dict[str, Any] = {}
    for _, path in COMPARED:
        node = median
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = float(np.median([_figure(summary, path) for summary in summaries]))
    return median


def _figure(summary: dict[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = summary
    for part in path:
        value = value[part]
    return value


def format_validation(name: str, rows: dict[str, Any]) -> str:
    lines = [f"   simulator vs measured ({name}):"]
    for key, row in rows.items():
        error = "n/a" if row["error"] is None else f"{row['error']:+.0%}"
        verdict = "ok" if row["within_tolerance"] else f"outside {TOLERANCE:.0%}"
        lines.append(
            f"     {key:<24} predicted {row['predicted']:10.4f}  measured "
            f"{row['measured'] if row['measured'] is not None else float('nan'):10.4f}  "
            f"error {error:>5}  {verdict}"
        )
    return "\n".join(lines)
