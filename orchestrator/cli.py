"""The ``pdserve`` command line. Subcommands import their implementation lazily so that
``pdserve --help`` stays fast and does not import torch."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence


def _make_model(args: argparse.Namespace) -> int:
    from workers.engine.presets import write_random_checkpoint

    path = write_random_checkpoint(args.preset, args.out, seed=args.seed)
    print(f"wrote {args.preset} checkpoint to {path}")
    return 0


def _fetch_demo_model(args: argparse.Namespace) -> int:
    from workers.engine.demo_model import fetch_demo_model

    path = fetch_demo_model(args.out)
    print(f"SmolLM2-135M-Instruct ready in {path}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from orchestrator.demo import run_demo

    return run_demo(model_dir=args.model, max_tokens=args.max_tokens)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-model", help="write a random-initialised HF-format checkpoint")
    p.add_argument("--preset", required=True, choices=["tiny", "small", "qwen3-tiny"])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_make_model)

    p = sub.add_parser(
        "fetch-demo-model", help="build the offline SmolLM2-135M-Instruct checkpoint"
    )
    p.add_argument("--out", default=None, help="output directory (default: the pdserve cache)")
    p.set_defaults(func=_fetch_demo_model)

    p = sub.add_parser("demo", help="answer a few prompts with the demo model and print timings")
    p.add_argument("--model", default=None, help="checkpoint directory (default: SmolLM2)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
