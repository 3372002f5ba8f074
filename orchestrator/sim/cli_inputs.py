"""The workload and serving options of ``pdserve simulate / plan``, from their flags; every
error is a ValueError that names the flag (the command reports it in one line)."""

from __future__ import annotations

import argparse

from orchestrator.sim.conversations import MultiTurnWorkload, parse_multiturn
from orchestrator.sim.options import ServingOptions
from orchestrator.sim.spec_profile import load_profile
from orchestrator.sim.speculative import SpecDecoding
from orchestrator.sim.workload import Arrivals, LengthDist, Workload

DEFAULT_NUM_REQUESTS = 200
MULTITURN_FLAGS = ("system_tokens", "question_tokens", "think_time")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def arrivals_from_args(args: argparse.Namespace) -> Arrivals:
    """An open-loop `Workload`, or multi-turn conversations for ``--prompt
    multiturn:CONVERSATIONS:TURNS``."""
    shape = parse_multiturn(args.prompt)
    output = LengthDist.parse(args.output)
    if shape is None:
        given = [_flag(name) for name in MULTITURN_FLAGS if getattr(args, name) is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: only with --prompt multiturn:C:T")
        return Workload(
            rate=args.rate,
            num_requests=(DEFAULT_NUM_REQUESTS if args.num_requests is None else args.num_requests),
            prompt=LengthDist.parse(args.prompt),
            output=output,
            arrival=args.arrival,
            seed=args.seed,
            prefix_hit=_prefix_hit(args.prefix_hit),
        )
    if args.num_requests is not None:
        raise ValueError("--num-requests: a multiturn workload sends CONVERSATIONS x TURNS")
    if args.prefix_hit:
        raise ValueError("--prefix-hit: a multiturn workload's hits come from its conversations")
    questions = args.question_tokens or "32-64"
    low, _, high = questions.partition("-")
    try:
        question = LengthDist("uniform", int(low), int(high or low))
    except ValueError:
        raise ValueError(f"--question-tokens: expected N or A-B, got {questions!r}") from None
    conversations, turns = shape
    return MultiTurnWorkload(
        rate=args.rate,
        num_conversations=conversations,
        turns=turns,
        output=output,
        system_tokens=256 if args.system_tokens is None else args.system_tokens,
        question=question,
        arrival=args.arrival,
        think_time_s=args.think_time or 0.0,
        seed=args.seed,
    )


def _prefix_hit(value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"--prefix-hit: a share of each prompt, in [0, 1], got {value}")
    return value


def _acceptance(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(
            f"--spec-acceptance: comma-separated probabilities per draft position, got {text!r}"
        ) from None
    return values


def speculative_from_args(args: argparse.Namespace) -> SpecDecoding | None:
    """From ``--spec-k``, ``--spec-acceptance`` / ``--spec-profile`` and ``--spec-method``."""
    k = args.spec_k
    if k is not None and k < 1:
        raise ValueError(f"--spec-k: drafts per step must be >= 1, got {k}")
    if args.spec_acceptance is not None and args.spec_profile is not None:
        raise ValueError("--spec-acceptance and --spec-profile: give one of them")
    if args.spec_acceptance is not None:
        acceptance = _acceptance(args.spec_acceptance)
        if k is not None and len(acceptance) != k:
            raise ValueError(
                f"--spec-acceptance: {len(acceptance)} values for --spec-k {k}: give one per "
                "draft position"
            )
    elif args.spec_profile is not None:
        try:
            acceptance = load_profile(args.spec_profile, k)
        except ValueError as error:
            raise ValueError(f"--spec-profile: {error}") from None
    elif k is not None:
        raise ValueError("--spec-k: give the acceptance (--spec-acceptance or --spec-profile)")
    else:
        return None
    try:
        return SpecDecoding(acceptance, args.spec_method)
    except ValueError as error:
        flag = "--spec-profile" if args.spec_profile is not None else "--spec-acceptance"
        raise ValueError(f"{flag}: {error}") from None


def options_from_args(args: argparse.Namespace) -> ServingOptions:
    return ServingOptions(
        speculative=speculative_from_args(args),
        prefix_caching=not args.no_prefix_caching,
        routing=args.routing,
        seed=args.seed,
    )
