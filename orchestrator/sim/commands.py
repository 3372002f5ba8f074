"""The ``simulate``, ``plan`` and ``calibrate`` subcommands of ``pdserve``.

Only argparse (and `orchestrator.cli.flags`, argparse only too) is imported here; each command
imports what it runs, so that ``pdserve --help`` stays fast.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import TYPE_CHECKING, Any

from orchestrator.cli.flags import add_connection_arguments, add_multiturn_arguments

if TYPE_CHECKING:
    from orchestrator.sim.cost import CostModel
    from orchestrator.sim.instances import EngineLimits
    from orchestrator.sim.metrics import SLO
    from orchestrator.sim.options import ServingOptions
    from orchestrator.sim.planner import Candidate
    from orchestrator.sim.simulator import Layout, SimResult
    from orchestrator.sim.workload import Arrivals

SLO_RUNS = 10  # the printed sweep's runs last at least this many TTFT SLOs of arrivals


def add_subcommands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("simulate", help="simulate a cluster layout under a synthetic workload")
    _add_model_arguments(p)
    p.add_argument(
        "--layout",
        action="append",
        required=True,
        help="PxTP:DxTP (e.g. 1x8:3x8, disaggregated) or MxTP (e.g. 4x8, mixed); repeatable. "
        "PxTP:DxTP:epK prices every K decode instances as one expert-parallel domain (e.g. "
        "1x8:3x8:ep3; a what-if: pdserve's engine keeps every expert in each instance)",
    )
    p.set_defaults(func=_simulate)

    p = sub.add_parser("plan", help="search P:D counts and TP sizes for the most goodput per GPU")
    _add_model_arguments(p)
    p.add_argument("--gpus", type=int, required=True, help="GPU budget")
    p.add_argument("--tp", default="1,2,4,8", help="TP sizes to consider (comma-separated)")
    p.add_argument("--no-mixed", action="store_true", help="leave out the mixed baseline")
    p.add_argument(
        "--expert-parallel",
        action="store_true",
        help="also try each decode group of a MoE model as one expert-parallel domain (roofline "
        "models; a what-if pdserve's engine does not run: nothing is emitted or applied for it)",
    )
    p.add_argument("--attainment", type=float, default=0.9, help="share of requests meeting SLOs")
    p.add_argument("--top", type=int, default=10)
    p.add_argument(
        "--min-duration", type=float, default=30.0, help="seconds of arrivals per run, at least"
    )
    p.add_argument("--emit-config", default=None, help="write the best layout's cluster config")
    p.add_argument("--emit-helm", default=None, help="write the best layout's Helm values")
    p.add_argument(
        "--emit-rival-config",
        default=None,
        help="write the cluster config of the best layout of the other kind (mixed against a "
        "disaggregated pick, and the other way round) and print the `pdserve bench sweep` "
        "that measures the pick against it: the check that the plan holds on this machine",
    )
    p.add_argument("--model-path", default="/models/model", help="model path in the config")
    p.add_argument("--provider", default="verbs;ofi_rxm", help="libfabric provider to emit")
    p.add_argument(
        "--apply",
        metavar="ADDRESS",
        default=None,
        help="then scale the cluster whose router is at ADDRESS to the best layout, one group "
        "at a time (replica counts only: another TP size or serving mode is refused)",
    )
    p.add_argument(
        "--apply-timeout", type=float, default=900.0, help="deadline of each group's scale (s)"
    )
    add_connection_arguments(p)  # for --apply
    p.set_defaults(func=_plan)

    p = sub.add_parser(
        "calibrate", help="measure the engine (and fabric) here; write a cost-model JSON"
    )
    p.add_argument("--out", default="calibration.json")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per point (median)")
    p.add_argument(
        "--preset",
        default="small",
        help="the engine preset measured (random weights): small, or deepseek-tiny for MLA "
        "and MoE steps",
    )
    p.add_argument("--fabric", action="store_true", help="also time loopback tcp writes")
    p.add_argument(
        "--decode-context",
        default="32,768",
        help="prompt lengths of the decode points (comma-separated): long ones let the fit "
        "see the per-KV-token cost of long-context decode",
    )
    p.add_argument(
        "--prefill-context",
        type=int,
        default=1024,
        help="length of the long prompt whose budget-sized chunks are the prefill points with "
        "cached context (a multiple of the 256-token chunk): at least the workload's longest "
        "prompt, so that the attention term is fitted, not extrapolated",
    )
    p.add_argument(
        "--decode-batch",
        default="1,8,32",
        help="batch sizes of the decode points (comma-separated)",
    )
    p.add_argument(
        "--concurrent",
        type=int,
        default=1,
        help="engine processes stepping at once: N-1 background engines decode while this one "
        "is measured, as the cluster's N workers share the cores (default 1: alone)",
    )
    p.add_argument(
        "--background",
        default=None,
        metavar="PROMPT,OUTPUT",
        help="with --concurrent: the background engines' requests, prompt and output tokens "
        "(rounds of 4; default: a decode-heavy 768,256; give the workload's mean prompt and "
        "output for a prefill-heavy one)",
    )
    p.add_argument(
        "--mixed-batch",
        default="4,16",
        help="decode batches of the mixed points (chunk steps with decodes; comma-separated; "
        "empty: none): checked against the fit, not fitted",
    )
    p.add_argument(
        "--from-trace",
        nargs="+",
        default=None,
        metavar="COMPARE.json",
        help="measure nothing: fit the step costs per worker role to the step traces saved in "
        "these pdserve bench compare results (the busy cycles of a served cluster, under its "
        "contention and CPU priorities)",
    )
    p.add_argument(
        "--shared-cores",
        type=float,
        default=None,
        metavar="C",
        help="with --from-trace: the traced workers shared C cores (the measuring machine's); "
        "fit core-seconds and let the simulator price each layout's own contention (each "
        "worker process computing on one thread, weighted by its group's nice)",
    )
    p.add_argument(
        "--overheads-from",
        default=None,
        metavar="COMPARE.json",
        help="derive the fixed per-request costs (router, RPCs, KV admission) from a saved "
        "pdserve bench compare result and store them in the calibration",
    )
    p.add_argument(
        "--overheads-against",
        default=None,
        metavar="CALIBRATION.json",
        help="the calibration to measure those residuals against (default: this one's fit); "
        "give one taken alone (--concurrent 1) when the compare run's lone requests ran alone",
    )
    p.set_defaults(func=_calibrate)


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cost",
        required=True,
        help="roofline:MODEL:GPU[:NIC][:key=value] (models: llama-3-70b, qwen3-coder-480b, "
        "deepseek-r1; GPUs: h100, h200; NICs: 8x400g, efa-3200g, 1x100g) or calibrated:PATH",
    )
    p.add_argument(
        "--rate",
        type=float,
        default=1.0,
        help="arrivals per second, conversations started per second with multiturn (plan: start)",
    )
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="default 200 (not with multiturn: it sends CONVERSATIONS x TURNS)",
    )
    p.add_argument("--arrival", choices=["poisson", "fixed"], default="poisson")
    p.add_argument(
        "--prompt",
        default="uniform:4096-8192",
        help="fixed:N | uniform:A-B | chat:M[:A-B] | multiturn:CONVERSATIONS:TURNS (each turn "
        "the conversation so far plus a question, sent when the previous answer is complete)",
    )
    p.add_argument(
        "--output",
        default="uniform:1024-2048",
        help="fixed:N | uniform:A-B | chat:M[:A-B] (multiturn: the answers)",
    )
    p.add_argument("--seed", type=int, default=0)
    add_multiturn_arguments(p)
    p.add_argument(
        "--prefix-hit",
        type=float,
        default=0.0,
        help="share of each prompt every instance finds in its prefix cache (whole pages)",
    )
    p.add_argument(
        "--no-prefix-caching", action="store_true", help="instances cache no prompt prefixes"
    )
    p.add_argument(
        "--routing",
        choices=["least_outstanding", "kv_aware"],
        default="least_outstanding",
        help="the router's policy (kv_aware: the decoder holding most of the prompt)",
    )
    p.add_argument("--spec-k", type=int, default=None, help="speculative decoding: drafts per step")
    p.add_argument(
        "--spec-acceptance",
        default=None,
        metavar="A0,A1,...",
        help="speculative decoding: per draft position, the chance it is kept given the ones "
        "before it were (DeepSeek reports 0.85-0.9 for R1's first MTP draft)",
    )
    p.add_argument(
        "--spec-profile",
        default=None,
        metavar="FILE",
        help="speculative decoding: acceptance from a saved /metrics scrape of our workers "
        "(needs --spec-k) or a JSON of counters or acceptance",
    )
    p.add_argument(
        "--spec-method",
        choices=["mtp", "ngram"],
        default="mtp",
        help="drafts from the model's MTP module (priced) or n-gram lookup (free)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--max-num-batched-tokens",
        default="2048",
        metavar="N[,N...]",
        help="prompt tokens a step may take (plan: a list to search on the instances that "
        "prefill; a disaggregated layout's decoders keep the first)",
    )
    p.add_argument(
        "--min-step-interval-ms",
        default="0",
        metavar="MS[,MS...]",
        help="decode-only steps start at least this long apart (limits.min_step_interval_ms; "
        "plan: a list to search on the instances that decode)",
    )
    p.add_argument("--ttft-slo", type=float, default=2.0, help="seconds")
    p.add_argument("--tpot-slo", type=float, default=0.05, help="seconds per output token")
    p.add_argument(
        "--max-itl-slo", type=float, default=None, help="seconds: bound on a request's longest gap"
    )
    p.add_argument(
        "--warmup", type=float, default=0.1, help="share of first/last arrivals left out"
    )


def parse_layout(text: str) -> Layout:
    """``PxTP:DxTP[:epK]`` or ``MxTP``; ``epK``: every K decode instances spread one copy of
    the routed experts over their GPUs (`Layout.ep_decode`)."""
    from orchestrator.sim.simulator import Layout

    usage = f"bad layout {text!r}: use PxTP:DxTP[:epK] or MxTP"

    def pair(part: str) -> tuple[int, int]:
        count, _, tp = part.lower().partition("x")
        return int(count), int(tp or 1)

    parts = text.split(":")
    ep = 1
    if len(parts) == 3 and parts[2].lower().startswith("ep"):
        try:
            ep = int(parts.pop()[2:])
        except ValueError:
            raise ValueError(usage) from None
    try:
        pairs = [pair(part) for part in parts]
    except ValueError:
        raise ValueError(usage) from None
    if len(pairs) == 1:
        return Layout(num_mixed=pairs[0][0], tp_mixed=pairs[0][1])
    if len(pairs) == 2:
        (p, tp_p), (d, tp_d) = pairs
        return Layout(num_prefill=p, num_decode=d, tp_prefill=tp_p, tp_decode=tp_d, ep_decode=ep)
    raise ValueError(usage)


def _refuse(command: str, error: Exception) -> int:
    """An input error (a bad flag, file or workload), reported at the command's edge."""
    print(f"pdserve {command}: {error}", file=sys.stderr)
    return 2


def _inputs(
    args: argparse.Namespace,
) -> tuple[Arrivals, SLO, EngineLimits, ServingOptions]:
    from orchestrator.sim.cli_inputs import arrivals_from_args, options_from_args
    from orchestrator.sim.instances import EngineLimits
    from orchestrator.sim.metrics import SLO, check_warmup

    check_warmup(args.warmup)
    workload = arrivals_from_args(args)
    options = options_from_args(args)
    budgets, intervals = _step_settings(args)
    limits = EngineLimits(args.max_num_seqs, budgets[0], min_step_interval_s=intervals[0] / 1000)
    return workload, SLO(args.ttft_slo, args.tpot_slo, args.max_itl_slo), limits, options


def _step_settings(args: argparse.Namespace) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """``--max-num-batched-tokens`` and ``--min-step-interval-ms`` as their lists of values
    (ValueError naming the flag for a value that is not a number)."""

    def values(flag: str, text: str, kind: type[int] | type[float]) -> tuple[Any, ...]:
        try:
            found = tuple(kind(part) for part in text.split(","))
        except ValueError:
            raise ValueError(f"{flag} wants a number or a comma list, got {text!r}") from None
        if len(set(found)) != len(found):
            raise ValueError(f"{flag} lists a value twice: {text!r}")
        return found

    return (
        values("--max-num-batched-tokens", args.max_num_batched_tokens, int),
        values("--min-step-interval-ms", args.min_step_interval_ms, float),
    )


def _workload_text(workload: Arrivals, args: argparse.Namespace) -> str:
    from orchestrator.sim.conversations import MultiTurnWorkload

    if isinstance(workload, MultiTurnWorkload):
        return (
            f"{workload.num_conversations} conversations x {workload.turns} turns, "
            f"{workload.arrival} {workload.rate}/s, system {workload.system_tokens} tokens, "
            f"questions {workload.question.low}-{workload.question.high}, answers {args.output}, "
            f"think {workload.think_time_s}s, seed {workload.seed}"
        )
    hit = f", prefix hit {args.prefix_hit:g}" if args.prefix_hit else ""
    return (
        f"{workload.num_requests} requests, {args.arrival} {workload.rate}/s, "
        f"prompt {args.prompt}, output {args.output}{hit}, seed {workload.seed}"
    )


def _slo_text(slo: SLO) -> str:
    text = f"TTFT <= {slo.ttft_s}s, TPOT <= {slo.tpot_s * 1e3:.0f}ms"
    bound = slo.max_itl_s
    return text + (f", max ITL <= {bound * 1e3:.0f}ms" if bound is not None else "")


def _simulate(args: argparse.Namespace) -> int:
    try:
        return _run_simulate(args)
    except (ValueError, OSError) as error:  # Unservable-, UnsupportedLayoutError: ValueErrors
        return _refuse("simulate", error)


def _run_simulate(args: argparse.Namespace) -> int:
    from orchestrator.sim.calibrated import load_mismatch
    from orchestrator.sim.cost import create_cost_model
    from orchestrator.sim.metrics import overloaded, prompt_work, summarize, unsettled
    from orchestrator.sim.simulator import simulate
    from orchestrator.sim.workload import Workload
    from workers.log import echo, progress, warn

    cost = create_cost_model(args.cost)
    workload, slo, limits, options = _inputs(args)
    if any(len(values) > 1 for values in _step_settings(args)):
        raise ValueError(
            "--max-num-batched-tokens and --min-step-interval-ms take one value here "
            "(pdserve plan searches lists)"
        )
    layouts = [parse_layout(text) for text in args.layout]
    print(f"cost model: {cost.name}")
    print(f"workload: {_workload_text(workload, args)}; SLO {_slo_text(slo)}")
    print(f"serving: {options.label()}")
    if isinstance(workload, Workload) and (mismatch := load_mismatch(cost, workload.rate)):
        warn(mismatch)
    shares_prefixes = not isinstance(workload, Workload) or workload.prefix_hit > 0
    for layout in progress(layouts, desc="simulating", unit="layout"):
        result = simulate(cost, layout, workload, limits, options)
        summary = summarize(result, slo, args.warmup)
        # Arrivals per second (a multi-turn run's turns come as fast as they are answered).
        rate = workload.rate if isinstance(workload, Workload) else summary_rate(result)
        per_node = rate / (layout.num_mixed or layout.num_decode)
        echo(f"{layout.label:<20} {per_node:5.2f} req/s per decoding instance | {summary.row()}")
        if shares_prefixes:  # what prefix caching saved (or would have)
            echo(f"{'':<20} {prompt_work(result, args.warmup).row()}")
        # An overloaded cluster has no steady state to wait for: say that alone.
        if rising := overloaded(result, args.warmup):
            warn(
                f"{layout.label}: overloaded: the mean TTFT rose from {rising[0]:.2f} s "
                f"(the first third of the measured requests) to {rising[1]:.2f} s (the last); "
                "the queue grew through the run, so every figure depends on its length: lower "
                "--rate (or raise --num-requests, should a burst of arrivals have caused it)"
            )
        elif short := unsettled(result, args.warmup):
            more = "--num-requests" if isinstance(workload, Workload) else "the conversations"
            warn(
                f"{layout.label}: not steady state: the {short[0]:.0f} s of arrivals left out "
                f"(--warmup {args.warmup}) are shorter than a measured request's mean "
                f"{short[1]:.0f} s in the cluster, which was still filling up; raise {more}"
            )
    return 0


def summary_rate(result: SimResult) -> float:
    """Requests arrived per second over the run."""
    times = [r.arrival_time for r in result.records]
    span = max(times) - min(times)
    return (len(times) - 1) / span if span > 0 else 0.0


def _plan(args: argparse.Namespace) -> int:
    try:
        return _run_plan(args)
    except (ValueError, OSError) as error:  # ConfigError and UnservableError are ValueErrors
        return _refuse("plan", error)


def _run_plan(args: argparse.Namespace) -> int:
    from orchestrator.sim.calibrated import load_mismatch
    from orchestrator.sim.cost import create_cost_model
    from orchestrator.sim.emit import check_helm_options, check_options
    from orchestrator.sim.planner import PlanSpec, format_table, plan, role_limits
    from orchestrator.sim.simulator import Layout
    from orchestrator.sim.workload import Workload
    from workers.log import warn

    cost = create_cost_model(args.cost)
    workload, slo, limits, options = _inputs(args)
    budgets, intervals = _step_settings(args)
    try:
        tp_choices = tuple(int(tp) for tp in args.tp.split(","))
    except ValueError:
        raise ValueError(f"--tp wants comma-separated TP sizes, got {args.tp!r}") from None
    spec = PlanSpec(
        workload=workload,
        slo=slo,
        gpu_budget=args.gpus,
        tp_choices=tp_choices,
        include_mixed=not args.no_mixed,
        attainment=args.attainment,
        limits=limits,
        warmup=args.warmup,
        min_duration_s=args.min_duration,
        options=options,
        expert_parallel=args.expert_parallel,
        prompt_budgets=budgets,
        step_intervals_s=tuple(ms / 1000 for ms in intervals),
    )
    searched = len(budgets) > 1 or len(intervals) > 1
    if args.expert_parallel and (
        args.emit_config or args.emit_helm or args.emit_rival_config or args.apply
    ):
        raise ValueError(
            "--expert-parallel plans layouts pdserve's engine does not run (each instance keeps "
            "every expert): leave out --emit-config, --emit-helm, --emit-rival-config and --apply"
        )
    if args.emit_rival_config and not args.emit_config:
        raise ValueError(
            "--emit-rival-config: give --emit-config too (the sweep measures the pick's config "
            "against the rival's)"
        )
    try:  # before a search of minutes: what no emitted config could carry
        for settings in role_limits(spec, Layout(1, 1)):
            check_options(
                settings.limits,
                prefill_limits=settings.prefill,
                model_path=args.model_path,
                provider=args.provider,
                cost=cost,
            )
    except ValueError as error:
        raise ValueError(f"--max-num-batched-tokens / --provider: {error}") from None
    if args.emit_helm:
        if cost.shared_cores is not None:
            raise ValueError(
                "--emit-helm: a plan on one machine's shared CPU cores (the calibration's "
                "shared_cores): the chart's pods run on GPU nodes"
            )
        try:  # and what no Helm values could
            check_helm_options(model_path=args.model_path, provider=args.provider)
        except ValueError as error:
            raise ValueError(f"--emit-helm: {error}") from None
    candidates = plan(cost, spec)
    print(f"cost model: {cost.name}; {len(candidates)} layouts within {args.gpus} GPUs")
    if cost.shared_cores is not None:
        print(
            f"every layout on the same {cost.shared_cores.cores:g} shared cores "
            "(an instance is a process there): ranked by goodput"
        )
    print(f"serving: {options.label()}")
    unit = "req/s" if isinstance(workload, Workload) else "conversations started per second"
    print(f"goodput: {unit} with >= {spec.attainment:.0%} meeting {_slo_text(slo)}")
    print(format_table(candidates, args.top, settings=searched))
    if not candidates or candidates[0].goodput == 0:
        print("no layout meets the SLOs; nothing emitted" + (" or applied" if args.apply else ""))
        return 1
    if isinstance(workload, Workload) and (mismatch := load_mismatch(cost, candidates[0].goodput)):
        warn(f"{candidates[0].layout.label}'s goodput: {mismatch}")
    if candidates[0].layout.ep_decode > 1:
        print(
            f"\nbest: {candidates[0].layout.label}, decoders as one expert-parallel domain: a "
            "what-if pdserve's engine does not run, so no config; the best layout it runs: "
            + next((c.layout.label for c in candidates if c.layout.ep_decode == 1), "none")
        )
        return 0
    best = candidates[0]
    settings = best.settings
    _emit(best.layout, settings.limits, cost, args, options, settings.prefill)
    if args.emit_rival_config:
        _emit_rival(candidates, cost, args, options, sweepable=isinstance(workload, Workload))
    if args.apply:
        import asyncio

        from orchestrator.cli.apply_layout import apply_layout

        if searched:  # scaling changes replica counts, never a running engine's limits
            print(
                f"--apply scales the groups to {best.layout.label}; the step settings it was "
                f"planned with ({settings.label(best.layout)}) take a restart with the config "
                "above"
            )
        return asyncio.run(apply_layout(best.layout, args))
    return 0


def _cluster_config(
    layout: Layout,
    limits: EngineLimits,
    cost: CostModel,
    args: argparse.Namespace,
    options: ServingOptions,
    prefill_limits: EngineLimits,
) -> dict[str, Any]:
    """``layout``'s cluster config as the orchestrator's loader accepts it (`emit`), or a
    ValueError naming the layout."""
    from orchestrator.sim.emit import checked_cluster_config

    try:
        return checked_cluster_config(
            layout,
            limits,
            cost,
            model_path=args.model_path,
            provider=args.provider,
            options=options,
            prefill_limits=prefill_limits,
        )
    except ValueError as error:
        message = f"the cluster config of {layout.label} would be refused: {error}"
        raise ValueError(message) from None


def _write_config(path: str, config: dict[str, Any]) -> None:
    """Write ``config`` to ``path`` with a relative model path rebased on the file's folder.

    Why: the loader resolves a config file's relative paths against the file's own folder,
    while --model-path, as every path on a command line, is relative to the working directory
    (a plan's config written to another folder named a model that was not there)."""
    import os

    import yaml

    model = os.path.expanduser(config["model"])
    if not os.path.isabs(model):
        folder = os.path.dirname(os.path.abspath(path))
        config = {**config, "model": os.path.relpath(os.path.abspath(model), folder)}
    with open(path, "w") as out:
        yaml.safe_dump(config, out, sort_keys=False)


def _emit(
    best: Layout,
    limits: EngineLimits,
    cost: CostModel,
    args: argparse.Namespace,
    options: ServingOptions,
    prefill_limits: EngineLimits,
) -> None:
    """Print the best layout's cluster config and Helm values (``limits``: its decode or
    mixed instances', ``prefill_limits`` its prefill instances'), and write them when asked:
    only once the orchestrator's loader accepts the config (a ConfigError otherwise)."""
    import yaml

    from orchestrator.sim.emit import helm_values

    config = _cluster_config(best, limits, cost, args, options, prefill_limits)
    print(f"\nbest: {best.label}")
    print("--- cluster config ---")
    print(yaml.safe_dump(config, sort_keys=False), end="")
    if args.emit_config:
        _write_config(args.emit_config, config)
    try:  # with --emit-helm, checked before the search
        values = helm_values(
            best,
            limits,
            cost=cost,
            model_path=args.model_path,
            provider=args.provider,
            options=options,
            prefill_limits=prefill_limits,
        )
    except ValueError as error:
        print(f"(no Helm values: {error})")
        return
    if values is None:
        print("(mixed layout: the Helm chart deploys prefill/decode groups only; no values)")
    else:
        print("--- Helm values ---")
        print(yaml.safe_dump(values, sort_keys=False), end="")
        if options.speculative is not None:
            print("(the chart's worker groups carry no speculative section: the plan's drafts)")
        if args.emit_helm:
            with open(args.emit_helm, "w") as out:
                yaml.safe_dump(values, out, sort_keys=False)


def _emit_rival(
    candidates: list[Candidate],
    cost: CostModel,
    args: argparse.Namespace,
    options: ServingOptions,
    sweepable: bool,
) -> None:
    """Write the rival's config (`planner.rival`) and print the sweep of the pick against it
    (``sweepable``: for a workload of single requests; a multi-turn plan gets the config only).

    Why: a plan is a prediction of a cost model; on shared cores it has picked a layout that
    lost the measured sweep (bench/history/RESULTS-notebook.md, "The planner's pick for the
    chat-like mix on the Zen 5 VM"). The sweep's runs last the plan's --min-duration at its
    highest rate, and at least `SLO_RUNS` TTFT SLOs, so that both sides reach steady state."""
    from orchestrator.sim.planner import rival

    best, other = candidates[0], rival(candidates)
    if other is None:
        print("\nno layout of the other kind meets the SLOs: no rival config written")
        return
    limits = other.settings
    config = _cluster_config(other.layout, limits.limits, cost, args, options, limits.prefill)
    _write_config(args.emit_rival_config, config)
    print(
        f"\nrival: {other.layout.label} ({other.goodput:.3f} req/s predicted, against "
        f"{best.goodput:.3f} for {best.layout.label}): {args.emit_rival_config}"
    )
    if not sweepable:
        return
    mixed, disaggregated = args.emit_config, args.emit_rival_config
    if not best.layout.is_mixed:
        mixed, disaggregated = disaggregated, mixed
    low, high = sorted((best.goodput, other.goodput))
    rates = sorted({round(rate, 2) for rate in (0.75 * low, low, high, 1.25 * high)})
    # A queue that grows at a tenth of the rate a side holds takes ten TTFT SLOs of arrivals
    # to delay a request past the SLO: shorter runs pass rates a side cannot hold (a 30-s
    # sweep passed both sides at 2.81 req/s where 200-request runs failed the rival at 2.25).
    requests = math.ceil(rates[-1] * max(args.min_duration, SLO_RUNS * args.ttft_slo))
    # Layouts on GPUs are ranked per GPU; on one machine's shared cores, by goodput.
    measure = "goodput" if cost.shared_cores is not None else "goodput per GPU"
    prefix = f" --prefix-hit {args.prefix_hit:g}" if args.prefix_hit else ""
    print(
        f"measure the pick against it (the plan holds if the pick's {measure} is the higher):\n"
        f"  pdserve bench sweep --disaggregated {disaggregated} --colocated {mixed} "
        f"--model {args.model_path} --rates {','.join(f'{r:g}' for r in rates)} "
        f"--seeds 0,1,2 --bisect 1 --prompt {args.prompt} --output {args.output}{prefix} "
        f"--num-requests {requests} --warmup {math.ceil(args.warmup * requests)} "
        f"--ttft-slo {args.ttft_slo:g} --tpot-slo {args.tpot_slo:g}"
    )


def _calibrate(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    import numpy as np

    from orchestrator.sim.calibrate import (
        BACKGROUND_OUTPUT,
        BACKGROUND_PROMPT,
        BUDGET,
        check_options,
        run_calibration,
    )
    from orchestrator.sim.calibrated import fit, load, mixed_errors

    try:
        contexts = tuple(int(c) for c in args.decode_context.split(","))
        mixed = tuple(int(b) for b in args.mixed_batch.split(",") if b.strip())
        batches = tuple(int(b) for b in args.decode_batch.split(","))
        result = json.loads(Path(args.overheads_from).read_text()) if args.overheads_from else None
        against = load(args.overheads_against) if args.overheads_against else None
        background = (BACKGROUND_PROMPT, BACKGROUND_OUTPUT)
        if args.background:
            parts = args.background.split(",")
            if len(parts) != 2 or not all(part.strip().isdigit() for part in parts):
                raise ValueError(
                    f"--background wants PROMPT,OUTPUT token counts, got {args.background!r}"
                )
            background = (int(parts[0]), int(parts[1]))
        check_options(
            args.concurrent,
            args.prefill_context,
            BUDGET,
            background,
            args.repeats,
            decode_batches=batches,
            decode_contexts=contexts,
            mixed_batches=mixed,
            preset=args.preset,
        )
        if args.from_trace:
            from orchestrator.sim.trace_fit import calibration_from_traces

            measuring = [
                flag
                for flag, given in (
                    ("--fabric", args.fabric),
                    ("--concurrent", args.concurrent != 1),
                    ("--background", args.background is not None),
                    ("--preset", args.preset != "small"),
                )
                if given
            ]
            if measuring:
                raise ValueError(f"--from-trace measures nothing: {', '.join(measuring)} unused")

            data = calibration_from_traces(args.from_trace, args.shared_cores)
            model = fit(data)
    except (ValueError, OSError) as error:
        return _refuse("calibrate", error)
    if not args.from_trace:  # writes args.out itself
        if args.shared_cores is not None:
            return _refuse("calibrate", ValueError("--shared-cores needs --from-trace"))
        data = run_calibration(
            args.out,
            repeats=args.repeats,
            fabric=args.fabric,
            decode_contexts=contexts,
            decode_batches=batches,
            concurrent=args.concurrent,
            mixed_batches=mixed,
            prefill_context=args.prefill_context,
            background=background,
            preset=args.preset,
        )
        model = fit(data)
    if result is not None:
        from orchestrator.loadgen.overheads import derive

        reference = model if against is None else against.without_overheads()
        data["overheads"] = derive(reference, result, Path(args.overheads_from).name)
        if against is not None:
            data["overheads"]["against"] = Path(args.overheads_against).name
    if args.from_trace or result is not None:
        # Traced points run to thousands: one line of JSON.
        Path(args.out).write_text(json.dumps(data, indent=None if args.from_trace else 2) + "\n")
    if args.from_trace:
        counts = ", ".join(f"{len(v)} of {role}" for role, v in sorted(data["roles"].items()))
        print(f"wrote the busy cycles of the traced workers ({counts}) to {args.out}")
        for role, (a, b, c, d, e) in model.role_coefficients:
            print(
                f"{role:<7} s = {a:.3g} + {b:.3g}*tokens + {c:.3g}*attention + {d:.3g}*batch "
                f"+ {e:.3g}*kv_tokens"
            )
        if model.shared_cores is not None:
            nice = ", ".join(f"{r} {n}" for r, n in model.shared_cores.role_nice)
            print(f"(core-seconds of {model.shared_cores.cores:g} shared cores; nice: {nice})")
    else:
        print(
            f"wrote {len(data['prefill'])} prefill, {len(data['decode'])} decode and "
            f"{len(data.get('transfer', []))} transfer points to {args.out}"
        )
    print(
        f"prefill s = {model.prefill_coefficients[0]:.3g} + {model.prefill_coefficients[1]:.3g}*tokens + {model.prefill_coefficients[2]:.3g}*attention"
    )
    print(
        f"decode  s = {model.decode_coefficients[0]:.3g} + {model.decode_coefficients[1]:.3g}*batch + {model.decode_coefficients[2]:.3g}*kv_tokens"
    )
    if model.alone_coefficients is not None:
        (p0, p1, p2), (d0, d1, d2) = model.alone_coefficients
        print(f"measured alone: prefill s = {p0:.3g} + {p1:.3g}*tokens + {p2:.3g}*attention")
        print(f"                decode  s = {d0:.3g} + {d1:.3g}*batch + {d2:.3g}*kv_tokens")
    print(
        f"transfer s = {model.transfer_coefficients[0]:.3g} + {model.transfer_coefficients[1]:.3g}*bytes"
    )
    errors = mixed_errors(model, data)
    if errors:
        print(
            f"mixed steps (chunk + decodes), fit vs measured: mean {np.mean(errors):+.0%}, "
            f"range {min(errors):+.0%}..{max(errors):+.0%} over {len(errors)} points"
        )
    if "overheads" in data:
        o = data["overheads"]
        print(
            f"request overheads: disaggregated {o.get('disaggregated_s', 0):.3f} s, "
            f"mixed {o.get('mixed_s', 0):.3f} s; token delay (mean) disaggregated "
            f"{o.get('disaggregated_token_s', 0) * 1e3:.2f} ms, "
            f"mixed {o.get('mixed_token_s', 0) * 1e3:.2f} ms (from {o['from']})"
        )
    print(f"use it with: --cost calibrated:{args.out}")
    return 0
