"""The ``pdserve`` command line. Subcommands import their implementation lazily so that
``pdserve --help`` stays fast and does not import torch."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from orchestrator.cli.flags import add_connection_arguments
from workers.log import configure_logging, set_progress


def _make_model(args: argparse.Namespace) -> int:
    from workers.engine.presets import write_random_checkpoint

    try:
        path = write_random_checkpoint(args.preset, args.out, seed=args.seed)
    except OSError as error:  # --out under a file, no permission, disk full
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.preset} checkpoint to {path}")
    return 0


def _fetch_demo_model(args: argparse.Namespace) -> int:
    from workers.engine.demo_model import MissingDemoExtraError, fetch_demo_model

    try:
        path = fetch_demo_model(args.out)
    # --out a user's own directory (refused), or under a file; gguf or transformers missing
    except (OSError, MissingDemoExtraError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"SmolLM2-135M-Instruct ready in {path}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from orchestrator.cli.demo import run_demo

    return run_demo(model_dir=args.model, max_tokens=args.max_tokens, config_path=args.config)


def _serve(args: argparse.Namespace) -> int:
    from orchestrator.control.launch import run_serve

    return run_serve(args)


def _generate(args: argparse.Namespace) -> int:
    import asyncio

    from orchestrator.cli.generate import generate

    try:
        return asyncio.run(generate(args))
    except KeyboardInterrupt:  # Ctrl-C: the request is cancelled with the stream
        return 130


def _scale(args: argparse.Namespace) -> int:
    import asyncio

    from orchestrator.cli.scale import scale

    return asyncio.run(scale(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bars (drawn only on a terminal)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-model", help="write a random-initialised HF-format checkpoint")
    p.add_argument(
        "--preset",
        required=True,
        choices=["tiny", "small", "qwen3-tiny", "deepseek-tiny", "qwen3-moe-tiny"],
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_make_model)

    p = sub.add_parser(
        "fetch-demo-model", help="build the offline SmolLM2-135M-Instruct checkpoint"
    )
    p.add_argument("--out", default=None, help="output directory (default: the pdserve cache)")
    p.set_defaults(func=_fetch_demo_model)

    p = sub.add_parser(
        "demo", help="serve the local 1P:3D cluster and answer a few prompts concurrently"
    )
    p.add_argument("--model", default=None, help="checkpoint directory (default: SmolLM2)")
    p.add_argument("--config", default=None, help="cluster config (default: local-1p3d.yaml)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.set_defaults(func=_demo)

    from orchestrator.control.launch import SIGNALS_HELP, add_serve_arguments

    p = sub.add_parser(
        "serve",
        help="start (or join) Ray, place the worker groups and serve the gRPC router",
        description="Start (or join) Ray, place the worker groups and serve the gRPC router "
        "until SIGINT / SIGTERM.",
        epilog=SIGNALS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )

    add_serve_arguments(p)
    p.set_defaults(func=_serve)

    p = sub.add_parser("generate", help="stream a completion of PROMPT from a running router")
    p.add_argument("prompt", help="text to complete")
    p.add_argument("--address", default="127.0.0.1:50051", help="router HOST:PORT")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None, help="unset: 1.0; 0 is greedy")
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap PROMPT in ChatML (<|im_start|> turns: SmolLM2's and Qwen's format), not the "
        "served model's own template: the router applies none over gRPC",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds")
    add_connection_arguments(p)
    p.set_defaults(func=_generate)

    p = sub.add_parser(
        "scale",
        help="set the replicas of a group of a serving cluster (new workers join when healthy, "
        "removed ones finish their requests first)",
    )
    p.add_argument("--address", default="127.0.0.1:50051", help="router HOST:PORT")
    p.add_argument("--group", required=True, help="prefill, decode or mixed")
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--timeout", type=float, default=900.0, help="deadline in seconds")
    add_connection_arguments(p)
    p.set_defaults(func=_scale)

    # simulate / plan / calibrate: the cluster simulator (orchestrator/sim/); argparse only.
    from orchestrator.sim.commands import add_subcommands as add_sim_subcommands

    add_sim_subcommands(sub)
    # bench run / compare / validate: the load generator (orchestrator/loadgen/); argparse only.
    from orchestrator.loadgen.commands import add_subcommands as add_bench_subcommands

    add_bench_subcommands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Unset: $PDSERVE_LOG_LEVEL, else INFO.
    configure_logging(logging.DEBUG if args.verbose else None)
    set_progress(not args.quiet)
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
