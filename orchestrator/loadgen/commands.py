"""``pdserve bench run``, ``compare``, ``sweep`` and ``validate``. Only argparse is imported here; each
command imports what it runs, so that ``pdserve --help`` stays fast."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.cli.flags import add_multiturn_arguments

if TYPE_CHECKING:
    from orchestrator.loadgen.compare import ClusterRun
    from orchestrator.loadgen.session import BenchOptions
    from orchestrator.sim.calibrated import CalibratedCostModel
    from orchestrator.sim.cost import CostModel


def add_subcommands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser(
        "bench", help="load generator (run, multiturn, compare, sweep, validate)"
    )
    commands = bench.add_subparsers(dest="bench_command", required=True)

    p = commands.add_parser("run", help="load a running router; report latencies and goodput")
    p.add_argument("--address", required=True, help="router gRPC HOST:PORT")
    p.add_argument("--http", default=None, help="router OpenAI base URL (http backend)")
    p.add_argument(
        "--api-key",
        default=None,
        help="bearer token of the router (gRPC and HTTP: router.auth.token)",
    )
    p.add_argument("--backend", choices=["grpc", "http"], default="grpc")
    _add_workload_arguments(p)
    p.set_defaults(func=_run)

    p = commands.add_parser(
        "multiturn",
        help="multi-turn chat conversations against a running router (gRPC): TTFT by turn",
    )
    p.add_argument("--address", required=True, help="router gRPC HOST:PORT")
    p.add_argument("--api-key", default=None, help="bearer token of the router")
    p.add_argument(
        "--prompt",
        default="multiturn:8:5",
        help="multiturn:CONVERSATIONS:TURNS (each turn: the conversation so far + a question)",
    )
    p.add_argument("--system-tokens", type=int, default=256, help="shared system prompt")
    p.add_argument("--question-tokens", default="32-64", help="N or A-B tokens per question")
    p.add_argument("--output-tokens", type=int, default=32, help="tokens per answer")
    p.add_argument("--rate", type=float, default=0.5, help="conversations started per second")
    p.add_argument("--arrival", choices=["poisson", "fixed"], default="poisson")
    p.add_argument("--think-time", type=float, default=0.0, help="seconds between turns")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-slo", type=float, default=2.0, help="seconds")
    p.add_argument("--tpot-slo", type=float, default=0.1, help="seconds per output token")
    p.add_argument("--timeout", type=float, default=600.0, help="per turn, seconds")
    p.add_argument("--json", default=None, help="write the summary and every turn here")
    p.set_defaults(func=_multiturn)

    p = commands.add_parser(
        "compare",
        help="the same workload on a disaggregated and a colocated cluster, one after the other",
    )
    p.add_argument("--disaggregated", required=True, help="cluster config (prefill + decode)")
    p.add_argument("--colocated", required=True, help="cluster config (mixed)")
    p.add_argument("--model", default=None, help="checkpoint directory (overrides the configs')")
    p.add_argument("--backend", choices=["grpc", "http"], default="grpc")
    p.add_argument("--num-cpus", type=int, default=None, help="embedded Ray's CPUs")
    p.add_argument(
        "--simulate",
        default=None,
        metavar="CALIBRATION.json",
        help="also predict both runs with the calibrated simulator and print the relative error",
    )
    _add_workload_arguments(p)
    p.set_defaults(func=_compare)

    p = commands.add_parser(
        "sweep",
        help="compare's two clusters over several rates and seeds: SLO attainment against rate "
        "and each cluster's goodput rate",
    )
    p.add_argument("--disaggregated", required=True, help="cluster config (prefill + decode)")
    p.add_argument("--colocated", required=True, help="cluster config (mixed)")
    p.add_argument("--model", default=None, help="checkpoint directory (overrides the configs')")
    p.add_argument("--backend", choices=["grpc", "http"], default="grpc")
    p.add_argument("--num-cpus", type=int, default=None, help="embedded Ray's CPUs")
    p.add_argument("--rates", required=True, help="arrivals per second, ascending: 0.25,0.5,1,2")
    p.add_argument("--seeds", default="0", help="workload seeds, each run at every rate: 0,1,2")
    p.add_argument(
        "--bisect",
        type=int,
        default=2,
        metavar="K",
        help="bisection steps between the highest passing and the next swept rate (0: none)",
    )
    _add_workload_arguments(p, sweep=True)
    p.add_argument("--json", default=None, help="write every run, the medians and goodput here")
    p.add_argument("--plot", default=None, help="write a PNG (attainment, ITL p99 vs rate) here")
    p.set_defaults(func=_sweep)

    p = commands.add_parser(
        "validate", help="the calibrated simulator's predictions for a saved compare result"
    )
    p.add_argument(
        "result",
        nargs="+",
        help="JSON written by bench compare --json; several repeats of one workload on the same "
        "configs are also checked against the median of their measurements",
    )
    p.add_argument("--calibration", required=True, help="JSON written by pdserve calibrate")
    p.add_argument(
        "--noise-seed",
        type=int,
        default=0,
        help="seed of the simulated step-time noise (calibrations from step traces only)",
    )
    p.add_argument(
        "--noise-repeats",
        type=int,
        default=1,
        help="simulate with seeds --noise-seed .. +N-1 and predict each figure's median",
    )
    overheads = p.add_mutually_exclusive_group()
    overheads.add_argument(
        "--overheads-from",
        default=None,
        metavar="COMPARE.json",
        help="derive the fixed per-request costs from this saved compare result instead of "
        "taking the calibration's",
    )
    p.add_argument(
        "--overheads-against",
        default=None,
        metavar="CALIBRATION.json",
        help="with --overheads-from: measure the residuals against this calibration (one "
        "taken alone) instead of --calibration",
    )
    overheads.add_argument(
        "--no-overheads", action="store_true", help="leave out the calibration's fixed costs"
    )
    p.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="also write every prediction, measurement and error to PATH",
    )
    p.set_defaults(func=_validate)


def _add_workload_arguments(p: argparse.ArgumentParser, *, sweep: bool = False) -> None:
    """``sweep``: without ``--rate``, ``--seed``, ``--json`` and ``--plot`` (its own)."""
    if not sweep:
        p.add_argument("--rate", type=float, default=1.0, help="arrivals per second")
    p.add_argument("--arrival", choices=["poisson", "fixed"], default="poisson")
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests, warm-up included (50; not with multiturn: it sends CONVERSATIONS x TURNS)",
    )
    p.add_argument("--duration", type=float, default=None, help="seconds of arrivals, at most")
    p.add_argument(
        "--prompt",
        default="uniform:512-1024",
        help="fixed:N | uniform:A-B | chat:M[:A-B]"
        + (
            ""
            if sweep
            else " | multiturn:CONVERSATIONS:TURNS (each turn: the conversation so "
            "far + a question; --rate: conversations started per second)"
        ),
    )
    p.add_argument(
        "--output",
        default="uniform:64-128",
        help="fixed:N | uniform:A-B | chat:M[:A-B] (multiturn: the answers)",
    )
    if not sweep:
        add_multiturn_arguments(p)
    if not sweep:
        p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prefix-hit",
        type=float,
        default=0.0,
        help="share of each prompt that is one prefix common to all of them (a system prompt), "
        "which the prefix caches hold once its first requests have run (0)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="first N requests left out of stats (multiturn: by id, conversation x turns + turn)",
    )
    p.add_argument("--ttft-slo", type=float, default=2.0, help="seconds")
    p.add_argument("--tpot-slo", type=float, default=0.1, help="seconds per output token")
    p.add_argument("--max-concurrency", type=int, default=1024, help="safety cap on streams")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    if not sweep:
        p.add_argument("--json", default=None, help="write the results here")
        p.add_argument("--plot", default=None, help="write a PNG (ITL over time, CDFs) here")


def _options(args: argparse.Namespace) -> BenchOptions:
    from orchestrator.loadgen.requests import bench_arrivals
    from orchestrator.loadgen.session import BenchOptions
    from orchestrator.loadgen.stats import SLOs

    return BenchOptions(
        workload=bench_arrivals(args),
        slos=SLOs(args.ttft_slo, args.tpot_slo),
        num_warmup=args.warmup,
        duration_s=args.duration,
        max_concurrency=args.max_concurrency,
        timeout_s=args.timeout,
        backend=args.backend,
        api_key=getattr(args, "api_key", None),
    )


def _workload_json(args: argparse.Namespace, options: BenchOptions) -> dict[str, Any]:
    """The flags that make the run's request list (`requests.document_specs` reads them);
    ``num_requests`` as run (None for a multi-turn workload, which counts its turns)."""
    from orchestrator.sim.workload import Workload

    keys = ("rate", "arrival", "duration", "prompt", "output", "seed", "prefix_hit", "warmup",
            "system_tokens", "question_tokens", "think_time")  # fmt: skip
    open_loop = isinstance(options.workload, Workload)
    return {
        **{key: getattr(args, key) for key in keys},
        "num_requests": options.workload.num_requests if open_loop else None,
    }


def _run(args: argparse.Namespace) -> int:
    from orchestrator.loadgen.report import machine_load, run_document, write_json, write_plot
    from orchestrator.loadgen.session import measure
    from orchestrator.loadgen.stats import format_summary

    try:
        options = _options(args)
    except ValueError as error:
        print(f"pdserve bench: {error}", file=sys.stderr)
        return 2
    import grpc

    load_before = machine_load()
    try:
        outcome, summary = asyncio.run(measure(args.address, args.http, options))
    except ValueError as error:  # the workload does not fit the served model
        print(f"pdserve bench: {error}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as error:  # the model info call: no router there
        print(
            f"pdserve bench: {args.address}: {error.code().name}: {error.details()}",
            file=sys.stderr,
        )
        return 2
    print(format_summary(f"{args.backend} {args.address}", summary))
    print(f"machine load: before {load_before} | after {machine_load()}")
    if args.json:
        document = {
            "command": "run",
            "argv": sys.argv,
            "workload": _workload_json(args, options),
            "machine_load": load_before,
            "runs": [run_document(args.backend, outcome, summary)],
        }
        write_json(args.json, document)
    if args.plot:
        write_plot(args.plot, [(args.backend, outcome)])
    return 0 if summary["errored"] == 0 else 1


def _multiturn(args: argparse.Namespace) -> int:
    import json

    from orchestrator.loadgen.conversations import (
        format_turns,
        measure_conversations,
        multiturn_shape,
    )
    from orchestrator.loadgen.stats import SLOs

    try:
        shape = multiturn_shape(args)
        slos = SLOs(args.ttft_slo, args.tpot_slo)
    except ValueError as error:
        print(f"pdserve bench multiturn: {error}", file=sys.stderr)
        return 2
    import grpc

    try:
        turns, summary = asyncio.run(
            measure_conversations(
                args.address, shape, slos, timeout_s=args.timeout, api_key=args.api_key
            )
        )
    except ValueError as error:
        print(f"pdserve bench multiturn: {error}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as error:
        print(
            f"pdserve bench multiturn: {args.address}: {error.code().name}: {error.details()}",
            file=sys.stderr,
        )
        return 2
    print(format_turns(summary))
    if args.json:
        document = {
            "command": "multiturn",
            "argv": sys.argv,
            "summary": summary,
            "turns": [
                {"conversation": t.conversation, "turn": t.turn, **t.result.to_json()}
                for t in turns
            ],
        }
        Path(args.json).write_text(json.dumps(document, indent=2))
    return 0 if summary["errored"] == 0 and summary["not_sent"] == 0 else 1


def _compare(args: argparse.Namespace) -> int:
    from orchestrator.loadgen.compare import format_ratios, load_config, ratios, run_cluster
    from orchestrator.loadgen.report import run_document, write_json, write_plot
    from orchestrator.loadgen.stats import format_summary
    from orchestrator.sim.calibrated import load

    try:
        options = _options(args)
        configs = [
            ("disaggregated", load_config(args.disaggregated, args.model)),
            ("colocated", load_config(args.colocated, args.model)),
        ]
        # Before minutes of benchmarking: a calibration that cannot be read fails now.
        cost = load(args.simulate) if args.simulate else None
    except (ValueError, OSError) as error:  # ConfigError is a ValueError
        print(f"pdserve bench compare: {error}", file=sys.stderr)
        return 2
    for name, config in configs:
        wanted = name == "disaggregated"
        if config.is_disaggregated != wanted:
            print(f"pdserve bench compare: --{name} config is not {name}", file=sys.stderr)
            return 2
    import grpc

    from workers.log import echo, progress

    runs = []
    try:
        # One step per cluster (start, run, stop); the run draws its own bar of requests.
        for name, config in progress(configs, desc="bench compare", unit="cluster", leave=True):
            run = asyncio.run(run_cluster(name, config, options, args.num_cpus))
            echo(format_summary(name, run.summary))
            echo(f"   machine load: before {run.load_before} | after {run.load_after}")
            runs.append(run)
    except ValueError as error:  # the workload does not fit the served model
        print(f"pdserve bench compare: {error}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as error:  # the cluster's router did not answer
        print(f"pdserve bench compare: {error.code().name}: {error.details()}", file=sys.stderr)
        return 2
    rows = ratios(runs[0].summary, runs[1].summary)
    print("\n" + format_ratios(rows))
    document = {
        "command": "compare",
        "argv": sys.argv,
        "workload": _workload_json(args, options),
        "configs": {"disaggregated": args.disaggregated, "colocated": args.colocated},
        "model": args.model,  # --model, which overrides the configs' (None: theirs)
        "machine_load": {r.name: [r.load_before, r.load_after] for r in runs},
        "runs": [run_document(r.name, r.outcome, r.summary, r.step_traces) for r in runs],
        "ratios": rows,
        "simulation": None,
    }
    if args.json:  # before the simulation: a measured run is never lost to it
        write_json(args.json, document)
    if args.plot:
        write_plot(args.plot, [(r.name, r.outcome) for r in runs])
    if cost is not None:
        try:
            document["simulation"] = _simulate_runs(cost, runs, options, args)
        except ValueError as error:  # e.g. a request the simulated pool cannot hold
            print(f"pdserve bench compare: --simulate: {error}", file=sys.stderr)
            return 2
        if args.json:
            write_json(args.json, document)
    return 0 if all(r.summary["errored"] == 0 for r in runs) else 1


def _sweep(args: argparse.Namespace) -> int:
    from orchestrator.loadgen.sweep_command import run_sweep

    return run_sweep(args, _options)


def _simulate_runs(
    cost: CostModel, runs: list[ClusterRun], options: BenchOptions, args: argparse.Namespace
) -> dict[str, Any]:
    from orchestrator.loadgen.requests import kept_specs
    from orchestrator.loadgen.validate import (
        acceptance_of,
        compare_to_measured,
        format_validation,
        predict,
    )
    from workers.log import echo, progress

    specs = kept_specs(options.workload, options.duration_s, options.num_warmup)
    validation: dict[str, Any] = {}
    for run in progress(runs, desc="simulating", unit="config"):
        acceptance = acceptance_of(run.step_traces)
        prediction = predict(cost, run.config, specs, args.warmup, acceptance=acceptance)
        validation[run.name] = compare_to_measured(prediction, run.summary)
        echo(format_validation(run.name, validation[run.name]))
    validation["calibration"] = args.simulate
    return validation


def _validate(args: argparse.Namespace) -> int:
    """Re-simulate a saved ``compare`` result (same workload, layouts, warm-up) with another
    calibration, without running the clusters again."""
    try:
        return _run_validate(args)
    except (ValueError, OSError) as error:  # ConfigError, UnservableError, bad JSON included
        print(f"pdserve bench validate: {error}", file=sys.stderr)
        return 2


def _validation_cost(args: argparse.Namespace) -> CalibratedCostModel:
    """``--calibration``, its fixed per-request costs replaced as the flags ask."""
    import json

    from orchestrator.sim.calibrated import load

    cost = load(args.calibration)
    if args.no_overheads:
        return cost.without_overheads()
    if args.overheads_from:
        from orchestrator.loadgen.overheads import derive

        source = Path(args.overheads_from)
        reference = load(args.overheads_against) if args.overheads_against else cost
        entry = derive(reference.without_overheads(), json.loads(source.read_text()), source.name)
        cost = cost.with_overheads(entry)
    return cost


def _run_validate(args: argparse.Namespace) -> int:
    import json

    from orchestrator.loadgen.compare import load_config
    from orchestrator.loadgen.requests import document_specs
    from orchestrator.loadgen.validate import (
        TOLERANCE,
        acceptance_of,
        compare_to_measured,
        format_validation,
        median_of,
        predict,
    )
    from workers.log import echo, progress

    documents = [json.loads(Path(result).read_text()) for result in args.result]
    for path, document in zip(args.result, documents, strict=True):
        if document.get("command") != "compare":
            print(f"pdserve bench validate: {path} is not a compare result", file=sys.stderr)
            return 2
        if (document["workload"], document["configs"]) != (
            documents[0]["workload"],
            documents[0]["configs"],
        ):
            print(
                f"pdserve bench validate: {path} ran another workload or other configs than "
                f"{args.result[0]}: only repeats of one compare can share a median",
                file=sys.stderr,
            )
            return 2
    if args.noise_repeats < 1:
        raise ValueError(f"--noise-repeats must be >= 1, got {args.noise_repeats}")
    seeds = range(args.noise_seed, args.noise_seed + args.noise_repeats)
    document = documents[0]
    cost = _validation_cost(args)
    print(
        f"{cost.name}: request overheads disaggregated {cost.request_overhead_s[0]:.3f} s, "
        f"mixed {cost.request_overhead_s[1]:.3f} s; token delay (mean) disaggregated "
        f"{cost.token_delay_s[0] * 1e3:.2f} ms, mixed {cost.token_delay_s[1] * 1e3:.2f} ms"
    )
    if cost.step_noise():
        print(
            f"step-time noise: seeds {seeds.start}..{seeds.stop - 1}"
            + (f", each figure the median of {len(seeds)} simulations" if len(seeds) > 1 else "")
        )
    specs, num_warmup = document_specs(document)
    # Per config: its rows against each result and, for several, against their median; the
    # closing count judges a set of repeats on the median, a single result on itself.
    checks: dict[str, dict[str, Any]] = {}
    judged: list[dict[str, Any]] = []
    # One step per config: len(seeds) simulations of the whole workload.
    for run in progress(document["runs"], desc="simulating", unit="config"):
        name = run["name"]
        config = load_config(document["configs"][name], None)
        # A speculating config: the acceptance its workers had over all the repeats.
        traces = [
            trace
            for other in documents
            for other_run in other["runs"]
            if other_run["name"] == name
            for trace in other_run.get("step_traces") or []
        ]
        prediction = predict(cost, config, specs, num_warmup, seeds, acceptance_of(traces))
        summaries, per_result = [], {}
        for path, other in zip(args.result, documents, strict=True):
            summary = next(r["summary"] for r in other["runs"] if r["name"] == name)
            summaries.append(summary)
            per_result[path] = compare_to_measured(prediction, summary)
            label = name if len(documents) == 1 else f"{name}, {Path(path).name}"
            echo(format_validation(label, per_result[path]))
        checks[name] = {"results": per_result}
        if len(documents) > 1:
            label = f"{name}, median of {len(documents)} runs"
            checks[name]["median"] = compare_to_measured(prediction, median_of(summaries))
            echo(format_validation(label, checks[name]["median"]))
        judged.extend((checks[name].get("median") or per_result[args.result[0]]).values())
    within = sum(row["within_tolerance"] for row in judged)
    against = "the median of the results" if len(documents) > 1 else "the result"
    print(f"within {TOLERANCE:.0%}: {within} of {len(judged)} figures, against {against}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "command": "validate",
                    "calibration": args.calibration,
                    "cost_model": cost.name,
                    "noise_seeds": list(seeds) if cost.step_noise() else [],
                    "results": list(args.result),
                    "within_tolerance": within,
                    "figures": len(judged),
                    "configs": checks,
                },
                indent=2,
            )
        )
    return 0
