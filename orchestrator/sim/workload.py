"""Seeded synthetic workloads: arrival process and prompt / output length distributions.

A `Workload` is a frozen description; `Workload.requests()` draws the same request list for
the same seed, so that runs at different rates (`with_rate`) or on different clusters see
the same lengths and only the arrival times scale. `Arrivals` is what the simulator runs: a
`Workload`, or multi-turn conversations (`conversations`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

import numpy as np

LengthKind = Literal["fixed", "uniform", "chat"]
ArrivalKind = Literal["poisson", "fixed"]


@dataclass(frozen=True)
class LengthDist:
    """Token lengths. ``fixed``: always ``low``. ``uniform``: integers in [low, high].
    ``chat``: a long-tailed lognormal (median ``median``, log-space spread ``sigma``) clipped
    to [low, high], the shape of chat prompt / answer lengths."""

    kind: LengthKind
    low: int
    high: int
    median: float = 0.0
    sigma: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "chat"):
            raise ValueError(f"length kind must be fixed, uniform or chat, got {self.kind!r}")
        if self.low < 1 or self.high < self.low:
            raise ValueError(f"need 1 <= low <= high, got {self.low}..{self.high}")
        if self.kind == "chat" and not (self.low <= self.median <= self.high and self.sigma > 0):
            raise ValueError(f"chat needs low <= median <= high and sigma > 0, got {self}")

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """``fixed:N``, ``uniform:LOW-HIGH`` or ``chat:MEDIAN[:LOW-HIGH]`` (default 16-32768)."""
        kind, _, rest = text.partition(":")
        try:
            if kind == "fixed":
                return cls("fixed", int(rest), int(rest))
            if kind == "uniform":
                low, high = (int(part) for part in rest.split("-"))
                return cls("uniform", low, high)
            if kind == "chat":
                median, _, bounds = rest.partition(":")
                low, high = (int(p) for p in bounds.split("-")) if bounds else (16, 32768)
                return cls("chat", low, high, median=float(median))
        except ValueError as exc:
            raise ValueError(f"bad length distribution {text!r}: {exc}") from None
        raise ValueError(f"bad length distribution {text!r}: use fixed:N, uniform:A-B, chat:M")

    @property
    def mean(self) -> float:
        if self.kind == "fixed":
            return float(self.low)
        if self.kind == "uniform":
            return (self.low + self.high) / 2
        # Unclipped lognormal mean; close enough for sizing a sweep.
        return min(self.high, self.median * math.exp(self.sigma**2 / 2))

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(count, self.low, dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(self.low, self.high + 1, size=count, dtype=np.int64)
        draws = rng.lognormal(math.log(self.median), self.sigma, size=count)
        return np.clip(np.rint(draws), self.low, self.high).astype(np.int64)


@dataclass(frozen=True)
class RequestSpec:
    """One request. The optional fields describe what its prompt shares with others, for the
    simulator's prefix caching (`caching`), and when a conversation's turn is sent:

    num_common_tokens: leading prompt tokens every instance holds cached (a workload's cache
        hit rate, or a system prompt all requests share; the caches are taken as warm).
    conversation: the multi-turn conversation it belongs to (-1: none); its leading
        ``num_history_tokens`` are that conversation's previous prompt and answer.
    follows: the request id of the conversation's previous turn (-1: none); the request is
        sent ``think_time_s`` after that one's last token, not at ``arrival_time``.
    """

    request_id: int
    arrival_time: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_common_tokens: int = 0
    conversation: int = -1
    num_history_tokens: int = 0
    follows: int = -1
    think_time_s: float = 0.0

    def __post_init__(self) -> None:
        shared = max(self.num_common_tokens, self.num_history_tokens)
        if min(self.num_common_tokens, self.num_history_tokens, self.think_time_s) < 0:
            raise ValueError(f"negative shared tokens or think time: {self}")
        if shared > self.num_prompt_tokens:
            raise ValueError(f"more shared tokens than the prompt has: {self}")


@dataclass(frozen=True)
class Workload:
    """``num_requests`` requests at ``rate`` per second (Poisson or evenly spaced).

    prefix_hit: share of each prompt every instance finds in its prefix cache (a workload's
    cache hit rate, e.g. a long system prompt all requests share). The load generator sends
    it as a prefix common to every prompt of a run (`loadgen.requests.build_requests`).
    """

    rate: float
    num_requests: int
    prompt: LengthDist
    output: LengthDist
    arrival: ArrivalKind = "poisson"
    seed: int = 0
    prefix_hit: float = 0.0

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"rate must be a positive number, got {self.rate}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.arrival not in ("poisson", "fixed"):
            raise ValueError(f"arrival must be poisson or fixed, got {self.arrival!r}")
        if not 0.0 <= self.prefix_hit <= 1.0:  # NaN fails too
            raise ValueError(f"prefix hit rate must be in [0, 1], got {self.prefix_hit}")

    @classmethod
    def from_args(cls, args: Any) -> Workload:
        """From the command-line flags `pdserve simulate / plan` and `pdserve bench` share
        (``--rate --num-requests --prompt --output --arrival --seed [--prefix-hit]``; a saved
        run from before ``--prefix-hit`` shared nothing)."""
        return cls(
            rate=args.rate,
            num_requests=args.num_requests,
            prompt=LengthDist.parse(args.prompt),
            output=LengthDist.parse(args.output),
            arrival=args.arrival,
            seed=args.seed,
            prefix_hit=getattr(args, "prefix_hit", 0.0),
        )

    def with_rate(self, rate: float) -> Workload:
        return replace(self, rate=rate)

    def at_rate(self, rate: float, min_duration_s: float) -> Workload:
        """At ``rate``, with enough requests for arrivals over ``min_duration_s`` at least."""
        return replace(
            self, rate=rate, num_requests=max(self.num_requests, math.ceil(rate * min_duration_s))
        )

    def with_seed(self, seed: int) -> Workload:
        return replace(self, seed=seed)

    def requests(self) -> list[RequestSpec]:
        # Separate streams for gaps and lengths: the lengths do not depend on the rate, and
        # unit-rate gaps scaled by 1/rate keep the arrival order of a seed across rates.
        lengths_rng = np.random.default_rng([self.seed, 1])
        prompts = self.prompt.sample(lengths_rng, self.num_requests)
        outputs = self.output.sample(lengths_rng, self.num_requests)
        if self.arrival == "fixed":
            gaps = np.ones(self.num_requests)
        else:
            gaps = np.random.default_rng([self.seed, 2]).exponential(1.0, self.num_requests)
        # The first request arrives at 0: a run measures from its first arrival.
        times = np.concatenate(([0.0], np.cumsum(gaps[1:]))) / self.rate
        return [
            RequestSpec(
                i,
                float(times[i]),
                int(prompts[i]),
                int(outputs[i]),
                num_common_tokens=int(self.prefix_hit * int(prompts[i])),
            )
            for i in range(self.num_requests)
        ]


class Arrivals(Protocol):
    """What the simulator and the planner run: a seeded list of requests at a rate (open-loop
    `Workload`, or the turns of `conversations.MultiTurnWorkload`)."""

    @property
    def rate(self) -> float: ...

    @property
    def seed(self) -> int: ...

    @property
    def num_requests(self) -> int: ...

    def requests(self) -> list[RequestSpec]: ...

    def at_rate(self, rate: float, min_duration_s: float) -> Arrivals: ...
