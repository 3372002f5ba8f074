"""Multi-turn chat load: conversations that share a system prompt, each turn's prompt the
conversation so far (every earlier prompt and answer) plus a new question.

The workload is the simulator's `orchestrator.sim.conversations.MultiTurnWorkload`: its seed
gives every conversation's start and every question's and answer's length, so a measured run
and its simulation (``pdserve bench validate``) send the same turns. Conversations start
open-loop (Poisson or fixed arrivals at ``rate`` conversations per second); within one, a turn
is sent when the previous one's answer is complete (its tokens are part of the next prompt),
after ``think_time_s``. Prompts are token ids drawn with the seed from the model's vocabulary
minus its EOS / special ids, like `orchestrator.loadgen.requests`; answers are greedy with
``ignore_eos``, so a run is repeatable. A failed turn ends its conversation (its later turns
are counted as not sent). Only the gRPC backend returns the answer's token ids, so it is the
one used.
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
from orchestrator.sim.conversations import MultiTurnWorkload
from orchestrator.sim.conversations import parse_multiturn as conversations_and_turns
from orchestrator.sim.workload import LengthDist
from workers.log import progress as progress_bar
from workers.log import progress_enabled, progress_shown


def parse_multiturn(
    spec: str,
    *,
    system_tokens: int = 256,
    question_tokens: tuple[int, int] = (32, 64),
    output_tokens: int = 32,
    rate: float = 0.5,
    arrival: str = "poisson",
    think_time_s: float = 0.0,
    seed: int = 0,
) -> MultiTurnWorkload:
    """``multiturn:CONVERSATIONS:TURNS`` with questions uniform in ``question_tokens``
    (inclusive) and answers of ``output_tokens`` each; ValueError on a bad shape."""
    shape = conversations_and_turns(spec)
    if shape is None:
        raise ValueError(f"expected multiturn:CONVERSATIONS:TURNS, got {spec!r}")
    low, high = question_tokens
    if not 1 <= low <= high or output_tokens < 1:
        raise ValueError(
            "question tokens must be a range A-B with 1 <= A <= B, and output tokens >= 1"
        )
    return MultiTurnWorkload(
        rate=rate,
        num_conversations=shape[0],
        turns=shape[1],
        output=LengthDist("fixed", output_tokens, output_tokens),
        system_tokens=system_tokens,
        question=LengthDist("uniform", low, high),
        arrival=arrival,  # type: ignore[arg-type]  # checked by MultiTurnWorkload
        think_time_s=think_time_s,
        seed=seed,
    )


@dataclass(frozen=True)
class Conversation:
    index: int
    start_s: float
    questions: tuple[tuple[int, ...], ...]
    answers: tuple[int, ...]  # tokens of each turn's answer


def build_conversations(
    workload: MultiTurnWorkload, vocab_size: int, excluded_ids: Iterable[int] = ()
) -> tuple[tuple[int, ...], list[Conversation]]:
    """The shared system prompt and every conversation's start, questions and answer
    lengths: the lengths and starts of ``workload.requests()``, the token ids drawn here."""
    excluded = set(excluded_ids)
    allowed = np.array([t for t in range(vocab_size) if t not in excluded], dtype=np.int64)
    if not len(allowed):
        raise ValueError(f"no token ids left to draw prompts from (vocab {vocab_size})")
    # Its own stream: the simulator's workload draws lengths and starts from [seed, 5 / 6].
    rng = np.random.default_rng([workload.seed, 4])
    system = tuple(int(t) for t in rng.choice(allowed, size=workload.system_tokens))
    specs = workload.requests()
    conversations = []
    for index in range(workload.num_conversations):
        turns = specs[index * workload.turns : (index + 1) * workload.turns]
        # A first turn's prompt is the system prompt and its question; a later one's starts
        # with its conversation's history.
        lengths = [
            s.num_prompt_tokens - (s.num_history_tokens if s.follows >= 0 else len(system))
            for s in turns
        ]
        questions = tuple(tuple(int(t) for t in rng.choice(allowed, size=n)) for n in lengths)
        answers = tuple(s.num_output_tokens for s in turns)
        conversations.append(Conversation(index, turns[0].arrival_time, questions, answers))
    return system, conversations


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt: tuple[int, ...]
    result: RequestResult


async def run_conversations(
    client: Client,
    workload: MultiTurnWorkload,
    system: Sequence[int],
    conversations: Sequence[Conversation],
    *,
    num_warmup: int = 0,
    progress: TextIO | None = sys.stderr,
) -> list[Turn]:
    """Every conversation's turns, in the order they were sent. A turn's index is its
    request id in ``workload.requests()`` (conversation x turns + turn); the first
    ``num_warmup`` of those are sent like the others and left out of the statistics."""
    loop = asyncio.get_running_loop()
    start = loop.time()

    def now() -> float:
        return loop.time() - start

    turns: list[Turn] = []
    total = len(conversations) * workload.turns
    bar = None
    if progress is not None and progress_enabled() and progress_shown(progress):
        bar = progress_bar(desc="bench multiturn", total=total, unit="turn", leave=True)

    async def converse(conversation: Conversation) -> None:
        await asyncio.sleep(max(0.0, conversation.start_s - now()))
        history = list(system)
        for number, question in enumerate(conversation.questions):
            if number and workload.think_time_s:
                await asyncio.sleep(workload.think_time_s)
            prompt = (*history, *question)
            index = conversation.index * workload.turns + number
            answer, warmup = conversation.answers[number], index < num_warmup
            request = TimedRequest(index, now(), prompt, answer, warmup)
            result = RequestResult(index, warmup, request.arrival_s, len(prompt), answer)
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


def summarize_turns(
    turns: Sequence[Turn], workload: MultiTurnWorkload, slos: SLOs
) -> dict[str, Any]:
    """The whole run's summary, TTFT by turn (both past the warm-up), and the prompt tokens
    every turn sent."""
    results = [t.result for t in turns]
    summary = summarize(results, slos)
    summary["not_sent"] = workload.num_requests - len(turns)
    summary["prompt_tokens_sent"] = sum(r.prompt_tokens for r in results)
    measured = [t for t in turns if not t.result.warmup]
    summary["ttft_by_turn_s"] = {
        str(number + 1): distribution(
            [
                ttft
                for t in measured
                if t.turn == number and t.result.ok and (ttft := t.result.ttft) is not None
            ]
        )
        for number in range(workload.turns)
    }
    later = [
        ttft for t in measured if t.turn > 0 and t.result.ok and (ttft := t.result.ttft) is not None
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


def multiturn_shape(args: Any) -> MultiTurnWorkload:
    """The workload of ``pdserve bench multiturn``'s arguments (ValueError on bad ones)."""
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
    workload: MultiTurnWorkload,
    slos: SLOs,
    *,
    num_warmup: int = 0,
    timeout_s: float = 600.0,
    api_key: str | None = None,
    progress: TextIO | None = sys.stderr,
) -> tuple[list[Turn], dict[str, Any]]:
    """Run ``workload`` against the router at ``address`` (gRPC); its turns and their
    summary (the first ``num_warmup`` turns by request id left out of it)."""
    from orchestrator.loadgen.clients import GrpcClient, model_info

    info = await model_info(address, token=api_key)
    longest = max(s.num_prompt_tokens + s.num_output_tokens for s in workload.requests())
    if longest > info.max_model_len:
        raise ValueError(
            f"a last turn may need {longest} tokens; {info.name} serves at most "
            f"{info.max_model_len} (fewer turns, or shorter questions or answers)"
        )
    system, conversations = build_conversations(workload, info.vocab_size, info.eos_token_ids)
    client = GrpcClient(address, timeout_s, api_key)
    try:
        turns = await run_conversations(
            client, workload, system, conversations, num_warmup=num_warmup, progress=progress
        )
    finally:
        await client.close()
    return turns, summarize_turns(turns, workload, slos)
