"""Open-loop arrivals: each request is sent at its scheduled time whether or not earlier ones
have finished (the arrival loop never awaits a completion).

``max_concurrency`` is a safety cap on streams in flight, not a load shape: a request that
arrives while the cap is full waits for a slot, and each such wait is counted (``cap_hits``)
and reported, since it means the run was no longer open-loop. Progress goes to stderr: a bar of
finished requests on a terminal; elsewhere (a log file) a line every 10 s and one at the end:
done/total, errors, elapsed. ``pdserve --quiet`` silences both.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

from orchestrator.loadgen.clients import Client, Clock
from orchestrator.loadgen.records import RequestResult
from orchestrator.loadgen.requests import TimedRequest
from workers.log import progress as progress_bar
from workers.log import progress_enabled, progress_shown


@dataclass
class RunOutcome:
    backend: str
    results: list[RequestResult]
    cap_hits: int
    max_concurrency: int
    wall_s: float


async def run_open_loop(
    client: Client,
    requests: Sequence[TimedRequest],
    *,
    max_concurrency: int = 1024,
    progress: TextIO | None = sys.stderr,
) -> RunOutcome:
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    start = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - start

    slots = asyncio.Semaphore(max_concurrency)
    results: list[RequestResult] = []
    tasks: list[asyncio.Task[None]] = []
    cap_hits = 0
    # Requests sent and not finished, counted here rather than read off the semaphore: when the
    # loop falls behind its schedule it creates several tasks without yielding, none of which
    # has taken a slot yet, and `slots.locked()` would miss exactly those waits.
    in_flight = 0

    if progress is not None and not progress_enabled():
        progress = None
    bar = None
    if progress is not None and progress_shown(progress):
        # Left on screen when done: the run's count of requests and errors.
        bar = progress_bar(
            desc=f"bench {client.name}",
            total=len(requests),
            unit="req",
            leave=True,
            stream=progress,
        )

    failed = 0  # for the bar

    async def one(request: TimedRequest, result: RequestResult) -> None:
        nonlocal in_flight, failed
        try:
            async with slots:
                await client.send(request, result, now)
        except Exception as error:
            # One request's failure is its own (a malformed stream the client did not foresee):
            # raised, it would fail `gather` and cancel every request in flight.
            result.error = f"{type(error).__name__}: {error}"
            result.finish_s = None
        finally:
            in_flight -= 1
            if bar is not None:
                failed += result.error is not None
                bar.set_postfix_str(f"{failed} errors", refresh=False)
                bar.update()

    # Not on a terminal: a line now and then for a log file.
    reporter = (
        asyncio.create_task(_report(progress, client.name, results, len(requests), now))
        if progress is not None and bar is None
        else None
    )
    try:
        for request in requests:
            delay = request.arrival_s - now()
            if delay > 0:
                await asyncio.sleep(delay)
            result = RequestResult(
                index=request.index,
                warmup=request.warmup,
                scheduled_s=request.arrival_s,
                prompt_tokens=request.num_prompt_tokens,
                max_tokens=request.max_tokens,
            )
            if in_flight >= max_concurrency:
                cap_hits += 1
            in_flight += 1
            results.append(result)
            tasks.append(asyncio.create_task(one(request, result)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        if bar is not None:
            bar.close()
        if reporter is not None:
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter
            _line(progress, client.name, results, len(requests), now())
    return RunOutcome(client.name, results, cap_hits, max_concurrency, now())


def _done(results: list[RequestResult]) -> tuple[int, int]:
    errors = sum(1 for r in results if r.error is not None)
    return sum(1 for r in results if r.ok) + errors, errors


async def _report(
    out: TextIO | None, name: str, results: list[RequestResult], total: int, now: Clock
) -> None:
    while True:
        await asyncio.sleep(10.0)
        _line(out, name, results, total, now())


def _line(
    out: TextIO | None, name: str, results: list[RequestResult], total: int, elapsed: float
) -> None:
    if out is None:
        return
    done, errors = _done(results)
    out.write(f"[bench {name}] {done}/{total} done, {errors} errors, {elapsed:6.1f} s\n")
    out.flush()
