"""``pdserve bench sweep``, the command: its arguments checked before any cluster starts, the
two clusters swept one after the other, the table, the JSON (rewritten after every run, so that
a sweep cut short keeps what it measured) and the plot."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import math
import sys
from collections.abc import Callable
from typing import Any

from orchestrator.loadgen.compare import load_config
from orchestrator.loadgen.goodput import Goodput, SweepRun
from orchestrator.loadgen.report import write_json
from orchestrator.loadgen.session import BenchOptions
from orchestrator.loadgen.sweep import ClusterSweep, SweepPlan, SweepProgress, sweep_cluster
from orchestrator.loadgen.sweep_report import (
    CLUSTERS,
    format_table,
    sweep_document,
    write_sweep_plot,
)
from orchestrator.sim.workload import Workload
from workers.log import echo

PREFIX = "pdserve bench sweep"


def parse_rates(text: str) -> tuple[float, ...]:
    """``0.25,0.5,1``: ascending, distinct, positive and finite."""
    try:
        rates = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--rates must be numbers separated by commas, got {text!r}") from None
    bad = [r for r in rates if not (r > 0 and math.isfinite(r))]
    if bad:
        raise ValueError(f"--rates must be positive, finite req/s, got {bad[0]:g}")
    if len(set(rates)) != len(rates):
        raise ValueError(f"--rates has a rate twice: {text}")
    if list(rates) != sorted(rates):
        raise ValueError(f"--rates must be in ascending order, got {text}")
    return rates


def parse_seeds(text: str) -> tuple[int, ...]:
    """``0,1,2``: at least one, distinct."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise ValueError("--seeds is empty: give at least one seed")
    try:
        seeds = tuple(int(part) for part in parts)
    except ValueError:
        raise ValueError(f"--seeds must be integers separated by commas, got {text!r}") from None
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds has a seed twice: {text}")
    return seeds


def build_plan(
    args: argparse.Namespace, options_of: Callable[[argparse.Namespace], BenchOptions]
) -> SweepPlan:
    """``options_of``: the bench options of a single-rate namespace (``commands._options``).
    ValueError, one line, for anything that would fail later."""
    rates, seeds = parse_rates(args.rates), parse_seeds(args.seeds)
    for flag, value in (("--ttft-slo", args.ttft_slo), ("--tpot-slo", args.tpot_slo)):
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{flag} must be a positive number of seconds, got {value}")
    if args.bisect < 0:
        raise ValueError(f"--bisect must be >= 0, got {args.bisect}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib (the bench extra)")
    options = options_of(argparse.Namespace(**{**vars(args), "rate": rates[0], "seed": seeds[0]}))
    if not isinstance(options.workload, Workload):
        raise ValueError("--prompt: a sweep runs open-loop requests; multiturn runs with compare")
    plan = SweepPlan(options, rates, seeds, args.bisect)
    # The warm-up must leave a request measured in every run (--duration keeps fewer requests
    # at lower rates); a probe lies above a swept rate, so it keeps at least as many.
    for rate in rates:
        for seed in seeds:
            plan.options_at(rate, seed)
    return plan


def run_sweep(
    args: argparse.Namespace, options_of: Callable[[argparse.Namespace], BenchOptions]
) -> int:
    try:
        plan = build_plan(args, options_of)
        configs = [(name, load_config(getattr(args, name), args.model)) for name in CLUSTERS]
    except (ValueError, OSError) as error:  # ConfigError is a ValueError
        print(f"{PREFIX}: {error}", file=sys.stderr)
        return 2
    for name, config in configs:
        if config.is_disaggregated != (name == "disaggregated"):
            print(f"{PREFIX}: --{name} config is not {name}", file=sys.stderr)
            return 2
    import grpc

    header = _header(args, plan)
    runs: list[SweepRun] = []
    goodputs: dict[str, Goodput] = {}

    def save(run: SweepRun | None = None) -> None:
        if run is not None:
            runs.append(run)
        if args.json:
            write_json(args.json, sweep_document(header, runs, goodputs, complete=False))

    tracker = SweepProgress(plan, len(configs))
    sweeps: list[ClusterSweep] = []
    try:
        for name, config in configs:
            sweep = asyncio.run(
                sweep_cluster(
                    name, config, plan, num_cpus=args.num_cpus, tracker=tracker, on_run=save
                )
            )
            sweeps.append(sweep)
            goodputs[name] = sweep.goodput
            save()
            echo(f"== {name}: goodput rate {sweep.goodput.describe()}")
    except ValueError as error:  # the workload does not fit the served model
        print(f"{PREFIX}: {error}{_kept(args, runs)}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as error:  # a cluster's router did not answer
        print(
            f"{PREFIX}: {error.code().name}: {error.details()}{_kept(args, runs)}", file=sys.stderr
        )
        return 2
    finally:
        tracker.close()
    echo("\n" + format_table(runs, goodputs, plan.options.slos, len(plan.seeds)))
    header["machine_load"] = {s.name: [s.load_before, s.load_after] for s in sweeps}
    if args.json:
        write_json(args.json, sweep_document(header, runs, goodputs, complete=True))
    if args.plot:
        write_sweep_plot(args.plot, runs, goodputs)
    # Errored requests count against attainment: at rates past a cluster's capacity they are
    # what the sweep measures, not a failure of the command.
    return 0


def _header(args: argparse.Namespace, plan: SweepPlan) -> dict[str, Any]:
    keys = ("arrival", "duration", "prompt", "output", "prefix_hit", "warmup")
    workload = {key: getattr(args, key) for key in keys}
    workload["num_requests"] = plan.options.workload.num_requests
    return {
        "command": "sweep",
        "argv": sys.argv,
        "workload": {**workload, "rates": list(plan.rates), "seeds": list(plan.seeds)},
        "slo": {"ttft_s": plan.options.slos.ttft_s, "tpot_s": plan.options.slos.tpot_s},
        "attainment_target": plan.target,
        "bisect_steps": plan.bisect_steps,
        "configs": {name: getattr(args, name) for name in CLUSTERS},
        "model": args.model,  # --model, which overrides the configs' (None: theirs)
        "backend": args.backend,
    }


def _kept(args: argparse.Namespace, runs: list[SweepRun]) -> str:
    return f" (the {len(runs)} runs measured are in {args.json})" if args.json and runs else ""
