"""Multi-turn chat load: conversations that share a system prompt, each turn's prompt the
conversation so far (every earlier prompt and answer) plus a new question.

Conversations start open-loop (Poisson or fixed arrivals at ``rate`` conversations per second);
within one, a turn is sent when the previous one's answer is complete (its tokens are part of
the next prompt), after ``think_time_s``. Prompts are token ids drawn with the seed from the
model's vocabulary minus its EOS / special ids, like `orchestrator.loadgen.requests`; answers
are greedy with ``ignore_eos``, so a run is repeatable. A failed turn ends its conversation
(its later turns are counted as not sent). Only the gRPC backend returns the answer's token ids,
so it is the one used.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

from orchestrator.loadgen.clients import Client
from orchestrator.loadgen.records import RequestResult
from orchestrator.loadgen.requests import TimedRequest
from orchestrator.loadgen.stats import SLOs, distribution, summarize
from workers.log import progress as progress_bar
from workers.log import progress_enabled, progress_shown


@dataclass(frozen=True)
class MultiTurn:
    """The shape of a multi-turn workload (`parse_multiturn` reads it from the command line)."""

    conversations: int
    turns: int
    system_tokens: int = 256
    question_tokens: tuple[int, int] = (32, 64)  # uniform, inclusive
    output_tokens: int = 32
    rate: float = 0.5  # conversations started per second
    arrival: str = "poisson"
    think_time_s: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        low, high = self.question_tokens
        if self.conversations < 1 or self.turns < 1:
            raise ValueError("conversations and turns must be >= 1")
        if self.system_tokens < 0 or not 1 <= low <= high or self.output_tokens < 1:
            raise ValueError(
                "system tokens must be >= 0, question tokens a range A-B with 1 <= A <= B, and "
                "output tokens >= 1"
            )
        if not self.rate > 0 or self.think_time_s < 0:
            raise ValueError("rate must be positive and think time >= 0")
        if self.arrival not in ("poisson", "fixed"):
            raise ValueError(f"arrival must be poisson or fixed, got {self.arrival!r}")

    def longest_prompt(self) -> int:
        """Tokens of the last turn's prompt at most (every question at its longest)."""
        return (
            self.system_tokens
            + self.turns * self.question_tokens[1]
            + (self.turns - 1) * self.output_tokens
        )


def parse_multiturn(spec: str, **options: Any) -> MultiTurn:
    """``multiturn:CONVERSATIONS:TURNS``, the rest from ``options`` (`MultiTurn`'s fields)."""
    parts = spec.split(":")
    if len(parts) != 3 or parts[0] != "multiturn":
        raise ValueError(f"expected multiturn:CONVERSATIONS:TURNS, got {spec!r}")
    try:
        conversations, turns = int(parts[1]), int(parts[2])
    except ValueError:
        raise ValueError(f"expected multiturn:CONVERSATIONS:TURNS, got {spec!r}") from None
    return MultiTurn(conversations, turns, **options)


@dataclass(frozen=True)
class Conversation:
    index: int
    start_s: float
    questions: tuple[tuple[int, ...], ...]


def build_conversations(
    shape: MultiTurn, vocab_size: int, excluded_ids: Iterable[int] = ()
) -> tuple[tuple[int, ...], list[Conversation]]:
    """The shared system prompt and every conversation's start and questions."""
    excluded = set(excluded_ids)
    allowed = np.array([t for t in range(vocab_size) if t not in excluded], dtype=np.int64)
    if not len(allowed):
        raise ValueError(f"no token ids left to draw prompts from (vocab {vocab_size})")
    rng = np.random.default_rng([shape.seed, 4])
    system = tuple(int(t) for t in rng.choice(allowed, size=shape.system_tokens))
    gaps = (
        rng.exponential(1.0 / shape.rate, size=shape.conversations)
        if shape.arrival == "poisson"
        else np.full(shape.conversations, 1.0 / shape.rate)
    )
    starts = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    low, high = shape.question_tokens
    conversations = []
    for index, start in enumerate(starts):
        lengths = rng.integers(low, high + 1, size=shape.turns)
        questions = tuple(tuple(int(t) for t in rng.choice(allowed, size=int(n))) for n in lengths)
        conversations.append(Conversation(index, float(start), questions))
    return system, conversations


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt: tuple[int, ...]
    result: RequestResult


async def run_conversations(
    client: Client,
    shape: MultiTurn,
    system: Sequence[int],
    conversations: Sequence[Conversation],
    *,
    progress: TextIO | None = sys.stderr,
) -> list[Turn]:
    """Every conversation's turns, in the order they were sent."""
    loop = asyncio.get_running_loop()
    start = loop.time()

    def now() -> float:
        return loop.time() - start

    turns: list[Turn] = []
    total = len(conversations) * shape.turns
    bar = None
    if progress is not None and progress_enabled() and progress_shown(progress):
        bar = progress_bar(desc="bench multiturn", total=total, unit="turn", leave=True)

    async def converse(conversation: Conversation) -> None:
        await asyncio.sleep(max(0.0, conversation.start_s - now()))
        history = list(system)
        for number, question in enumerate(conversation.questions):
            if number and shape.think_time_s:
                await asyncio.sleep(shape.think_time_s)
            prompt = (*history, *question)
            index = conversation.index * shape.turns + number
            request = TimedRequest(index, now(), prompt, shape.output_tokens, False)
            result = RequestResult(
                index, False, request.arrival_s, len(prompt), shape.output_tokens
            )
            turns.append(Turn(conversation.index, number, prompt, result))
            try:
                await client.send(request, result, now)
            except Exception as error:  # as the open-loop runner: one turn's failure is its own
                result.error, result.finish_s = f"{type(error).__name__}: {error}", None
            if bar is not None:
                bar.update()
            if not result.ok:
                break  # the next prompt would need this answer
            history = [*prompt, *result.token_ids]

    try:
        await asyncio.gather(*(converse(c) for c in conversations))
    finally:
        if bar is not None:
            bar.close()
    if progress is not None and bar is None and progress_enabled():
        done = sum(1 for t in turns if t.result.ok)
        progress.write(f"[bench multiturn] {done}/{total} turns done, {now():.1f} s\n")
    return turns


def summarize_turns(turns: Sequence[Turn], shape: MultiTurn, slos: SLOs) -> dict[str, Any]:
    """The whole run's summary, TTFT by turn, and the prompt tokens the turns sent."""
    results = [t.result for t in turns]
    summary = summarize(results, slos)
    summary["not_sent"] = shape.conversations * shape.turns - len(turns)
    summary["prompt_tokens_sent"] = sum(r.prompt_tokens for r in results)
    summary["ttft_by_turn_s"] = {
        str(number + 1): distribution(
            [
                ttft
                for t in turns
                if t.turn == number and t.result.ok and (ttft := t.result.ttft) is not None
            ]
        )
        for number in range(shape.turns)
    }
    later = [
        ttft for t in turns if t.turn > 0 and t.result.ok and (ttft := t.result.ttft) is not None
    ]
    summary["ttft_later_turns_s"] = distribution(later)
    return summary


def format_turns(summary: dict[str, Any]) -> str:
    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value * 1000:.0f}"

    lines = [
        f"turns: {summary['completed']} completed, {summary['errored']} errored, "
        f"{summary['not_sent']} not sent; prompt tokens sent {summary['prompt_tokens_sent']}",
        f"{'turn':>6} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12}",
    ]
    for number, ttft in summary["ttft_by_turn_s"].items():
        lines.append(f"{number:>6} {ms(ttft['p50']):>12} {ms(ttft['p99']):>12}")
    later = summary["ttft_later_turns_s"]
    lines.append(f"{'>= 2':>6} {ms(later['p50']):>12} {ms(later['p99']):>12}")
    lines.append(
        f"ITL p99 {ms(summary['itl_s']['p99'])} ms, TPOT mean {ms(summary['tpot_s']['mean'])} ms"
    )
    return "\n".join(lines)


def multiturn_shape(args: Any) -> MultiTurn:
    """`MultiTurn` from ``pdserve bench multiturn``'s arguments (ValueError on bad ones)."""
    low, _, high = str(args.question_tokens).partition("-")
    try:
        questions = (int(low), int(high or low))
    except ValueError:
        raise ValueError(
            f"--question-tokens: expected N or A-B, got {args.question_tokens!r}"
        ) from None
    return parse_multiturn(
        args.prompt,
        system_tokens=args.system_tokens,
        question_tokens=questions,
        output_tokens=args.output_tokens,
        rate=args.rate,
        arrival=args.arrival,
        think_time_s=args.think_time,
        seed=args.seed,
    )


async def measure_conversations(
    address: str,
    shape: MultiTurn,
    slos: SLOs,
    *,
    timeout_s: float = 600.0,
    api_key: str | None = None,
    progress: TextIO | None = sys.stderr,
) -> tuple[list[Turn], dict[str, Any]]:
    """Run ``shape`` against the router at ``address`` (gRPC); its turns and their summary."""
    from orchestrator.loadgen.clients import GrpcClient, model_info

    info = await model_info(address, token=api_key)
    longest = shape.longest_prompt() + shape.output_tokens
    if longest > info.max_model_len:
        raise ValueError(
            f"a last turn may need {longest} tokens; {info.name} serves at most "
            f"{info.max_model_len} (fewer turns, or shorter questions or answers)"
        )
    system, conversations = build_conversations(shape, info.vocab_size, info.eos_token_ids)
    client = GrpcClient(address, timeout_s, api_key)
    try:
        turns = await run_conversations(client, shape, system, conversations, progress=progress)
    finally:
        await client.close()
    return turns, summarize_turns(turns, shape, slos)
