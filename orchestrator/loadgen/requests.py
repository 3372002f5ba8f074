"""A `Workload` → the timed requests the load generator sends.

Lengths and arrival times come from `orchestrator.sim.workload.Workload.requests()`, so the
load generator and the simulator run the very same request list for a seed. Prompts are token
ids (exact lengths, no tokenizer round trip), drawn with the workload's seed from the model's
vocabulary minus its EOS / special ids. (Multi-turn conversations, ``--prompt
multiturn:C:T``, are sent by `orchestrator.loadgen.conversations`; their turns' lengths and
starts come from the simulator's workload in the same way.)
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from orchestrator.sim.conversations import parse_multiturn
from orchestrator.sim.workload import Arrivals, RequestSpec, Workload

DEFAULT_NUM_REQUESTS = 50  # ``pdserve bench``'s open-loop runs


@dataclass(frozen=True)
class TimedRequest:
    index: int
    arrival_s: float  # scheduled send time, seconds from the run's start
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    warmup: bool  # sent like any other, left out of the statistics

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def build_requests(
    workload: Workload,
    vocab_size: int,
    *,
    excluded_ids: Iterable[int] = (),
    num_warmup: int = 0,
    duration_s: float | None = None,
    prompt_stream: int = 0,
) -> list[TimedRequest]:
    """The workload's requests with prompts; arrivals after ``duration_s`` are dropped (a bound
    on the run, not a rate change). The first ``num_warmup`` are marked warm-up.
    ``prompt_stream``: other prompts (same lengths and arrivals) for each value; runs against
    one cluster that must not find each other's prompts in its prefix caches take distinct
    streams (0: the seed's own prompts).

    A workload's ``prefix_hit`` is sent as one prefix common to every prompt of the run, like a
    system prompt: each prompt starts with its ``num_common_tokens`` first tokens, then goes
    on as without it. The first requests to reach an instance compute it; the warm-up is what
    lets the measured ones find it cached, as the simulator takes it to be."""
    specs = kept_specs(workload, duration_s, num_warmup)
    excluded = set(excluded_ids)
    allowed = np.array([t for t in range(vocab_size) if t not in excluded], dtype=np.int64)
    if not len(allowed):
        raise ValueError(f"no token ids left to draw prompts from (vocab {vocab_size})")
    # Its own stream (index 3): workload.py uses [seed, 1] and [seed, 2].
    stream = [prompt_stream] if prompt_stream else []
    rng = np.random.default_rng([workload.seed, 3, *stream])
    # The common prefix from a stream of its own (index 4), so that the rest of each prompt is
    # the one it would be without it.
    longest = max((spec.num_common_tokens for spec in specs), default=0)
    common = np.random.default_rng([workload.seed, 4, *stream]).choice(allowed, size=longest)
    out = []
    for spec in specs:
        ids = rng.choice(allowed, size=spec.num_prompt_tokens)
        ids[: spec.num_common_tokens] = common[: spec.num_common_tokens]
        out.append(
            TimedRequest(
                index=spec.request_id,
                arrival_s=spec.arrival_time,
                prompt_token_ids=tuple(int(t) for t in ids),
                max_tokens=spec.num_output_tokens,
                warmup=spec.request_id < num_warmup,
            )
        )
    return out


def bench_arrivals(args: Any) -> Arrivals:
    """The workload of ``pdserve bench``'s flags (or a saved run's): open-loop requests
    (``--num-requests``, 50 when not given), or, for ``--prompt multiturn:C:T``, the
    simulator's multi-turn conversations (`orchestrator.sim.cli_inputs.arrivals_from_args`:
    ``--system-tokens``, ``--question-tokens``, ``--think-time``). ValueError names the flag."""
    from orchestrator.sim.cli_inputs import MULTITURN_FLAGS, arrivals_from_args

    flags = {name: getattr(args, name, None) for name in MULTITURN_FLAGS}
    fields = {**vars(args), **flags, "prefix_hit": getattr(args, "prefix_hit", 0.0)}
    if parse_multiturn(args.prompt) is not None:
        if getattr(args, "duration", None) is not None:
            raise ValueError("--duration: a multiturn workload sends CONVERSATIONS x TURNS")
    elif fields["num_requests"] is None:
        fields["num_requests"] = DEFAULT_NUM_REQUESTS
    return arrivals_from_args(argparse.Namespace(**fields))


def kept_specs(
    workload: Arrivals, duration_s: float | None, num_warmup: int = 0
) -> list[RequestSpec]:
    """The workload's specs that arrive within ``duration_s`` (all when None); ValueError
    unless the first ``num_warmup`` of them (warm-up) leave at least one to measure."""
    if duration_s is not None and not duration_s > 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    specs = workload.requests()
    if duration_s is not None:
        specs = [s for s in specs if s.arrival_time <= duration_s]
    # Against the requests kept, not num_requests: a duration that keeps no more than the
    # warm-up leaves nothing measured, and every summary and simulation of it is empty.
    if not 0 <= num_warmup < len(specs):
        within = "" if duration_s is None else f" arriving within {duration_s} s"
        raise ValueError(
            f"warm-up must be in [0, {len(specs)}) (the requests{within}), got {num_warmup}"
        )
    return specs


def document_specs(document: dict[str, Any]) -> tuple[list[RequestSpec], int]:
    """The request list a saved ``compare`` result ran (its workload's seed, lengths and
    arrivals), and its number of warm-up requests."""
    w = document["workload"]  # the flags the load generator ran with
    workload = bench_arrivals(SimpleNamespace(**w))
    return kept_specs(workload, w.get("duration"), w["warmup"]), int(w["warmup"])
