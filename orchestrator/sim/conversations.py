"""Multi-turn chat for the simulator: conversations that share a system prompt, each turn's
prompt the conversation so far (every earlier question and answer) plus a new question.

The load generator sends this very workload (`orchestrator.loadgen.conversations`, for
``pdserve bench multiturn``, ``run`` and ``compare``): the starts and lengths drawn here, its
own token ids. Conversations start open-loop at ``rate`` per second (Poisson or evenly
spaced), and a conversation's next turn is sent ``think_time_s`` after the previous answer's
last token. Answers are drawn from ``output`` (the load generator's are greedy with
``ignore_eos``, so as long as asked), so every prompt's length is known before the run.

What a turn shares with others, for prefix caching (`caching`): the system prompt (with every
request: ``num_common_tokens``) and its conversation's previous prompt and answer
(``num_history_tokens``), held by the instances that served that turn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from orchestrator.sim.workload import ArrivalKind, LengthDist, RequestSpec


@dataclass(frozen=True)
class MultiTurnWorkload:
    """``num_conversations`` of ``turns`` turns, started at ``rate`` per second."""

    rate: float
    num_conversations: int
    turns: int
    output: LengthDist
    system_tokens: int = 256
    question: LengthDist = field(default_factory=lambda: LengthDist("uniform", 32, 64))
    arrival: ArrivalKind = "poisson"
    think_time_s: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"conversation rate must be a positive number, got {self.rate}")
        if self.num_conversations < 1 or self.turns < 1:
            raise ValueError(
                f"conversations and turns must be >= 1, got {self.num_conversations} "
                f"and {self.turns}"
            )
        if self.system_tokens < 0:
            raise ValueError(f"system tokens must be >= 0, got {self.system_tokens}")
        if not (math.isfinite(self.think_time_s) and self.think_time_s >= 0):
            raise ValueError(f"think time must be >= 0 seconds, got {self.think_time_s}")
        if self.arrival not in ("poisson", "fixed"):
            raise ValueError(f"arrival must be poisson or fixed, got {self.arrival!r}")

    @property
    def num_requests(self) -> int:
        return self.num_conversations * self.turns

    def with_seed(self, seed: int) -> MultiTurnWorkload:
        return replace(self, seed=seed)

    def at_rate(self, rate: float, min_duration_s: float) -> MultiTurnWorkload:
        """At ``rate`` conversations per second, with enough conversations to keep starting
        them for ``min_duration_s`` at least."""
        count = max(self.num_conversations, math.ceil(rate * min_duration_s))
        return replace(self, rate=rate, num_conversations=count)

    def requests(self) -> list[RequestSpec]:
        """Every turn; request id = conversation * turns + turn. A first turn arrives at its
        conversation's start, a later one ``follows`` the turn before it."""
        # Separate streams, as `Workload.requests`: the lengths do not depend on the rate.
        lengths_rng = np.random.default_rng([self.seed, 5])
        count = self.num_conversations
        questions = self.question.sample(lengths_rng, count * self.turns).reshape(count, -1)
        answers = self.output.sample(lengths_rng, count * self.turns).reshape(count, -1)
        if self.arrival == "fixed":
            gaps = np.ones(count)
        else:
            gaps = np.random.default_rng([self.seed, 6]).exponential(1.0, count)
        starts = np.concatenate(([0.0], np.cumsum(gaps[1:]))) / self.rate
        specs = []
        for conversation in range(count):
            history = self.system_tokens  # tokens before this turn's question
            previous = -1
            for turn in range(self.turns):
                request_id = conversation * self.turns + turn
                prompt = history + int(questions[conversation, turn])
                specs.append(
                    RequestSpec(
                        request_id,
                        float(starts[conversation]),  # a later turn's is set by the run
                        prompt,
                        int(answers[conversation, turn]),
                        num_common_tokens=self.system_tokens,
                        conversation=conversation,
                        num_history_tokens=history if turn else 0,
                        follows=previous,
                        think_time_s=self.think_time_s if turn else 0.0,
                    )
                )
                history, previous = prompt + int(answers[conversation, turn]), request_id
        return specs

    def longest_prompt(self) -> int:
        """Tokens of the longest turn's prompt (as `MultiTurn.longest_prompt` for fixed
        lengths)."""
        return max(spec.num_prompt_tokens for spec in self.requests())


def parse_multiturn(text: str) -> tuple[int, int] | None:
    """(conversations, turns) of ``multiturn:CONVERSATIONS:TURNS`` (the load generator's
    ``--prompt`` form), None for any other ``--prompt``."""
    kind, _, rest = text.partition(":")
    if kind != "multiturn":
        return None
    parts = rest.split(":")
    try:
        conversations, turns = (int(part) for part in parts)
    except ValueError:
        raise ValueError(f"expected multiturn:CONVERSATIONS:TURNS, got {text!r}") from None
    return conversations, turns
