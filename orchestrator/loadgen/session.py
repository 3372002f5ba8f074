"""One measured run against a running router: ask it for the model (vocabulary, EOS ids),
build the request list, stream it open-loop over the chosen API, summarize. A multi-turn
workload's conversations go through `orchestrator.loadgen.conversations` instead (gRPC)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Literal, TextIO

from orchestrator.loadgen.clients import Client, GrpcClient, HttpClient, model_info
from orchestrator.loadgen.requests import build_requests, kept_specs
from orchestrator.loadgen.runner import RunOutcome, run_open_loop
from orchestrator.loadgen.stats import SLOs, summarize
from orchestrator.sim.conversations import MultiTurnWorkload
from orchestrator.sim.workload import Arrivals, Workload

Backend = Literal["grpc", "http"]


@dataclass(frozen=True)
class BenchOptions:
    workload: Arrivals  # open-loop `Workload` or `MultiTurnWorkload`
    slos: SLOs
    num_warmup: int = 0
    duration_s: float | None = None
    max_concurrency: int = 1024
    timeout_s: float = 600.0  # per request
    backend: Backend = "grpc"
    api_key: str | None = None
    prompt_stream: int = 0  # `requests.build_requests`: runs on one cluster that must not share

    def __post_init__(self) -> None:
        # Before any cluster runs: a warm-up that leaves no request measured (after the
        # duration cut) makes a run that measures nothing and a simulation that fails.
        kept_specs(self.workload, self.duration_s, self.num_warmup)
        if self.prompt_stream < 0:
            raise ValueError(f"prompt_stream must be >= 0, got {self.prompt_stream}")
        if isinstance(self.workload, MultiTurnWorkload) and self.backend != "grpc":
            # A turn's prompt holds the previous answer's token ids, which only gRPC returns.
            raise ValueError("a multiturn workload runs over the grpc backend only")


async def measure(
    address: str,
    http_url: str | None,
    options: BenchOptions,
    progress: TextIO | None = sys.stderr,
) -> tuple[RunOutcome, dict[str, Any]]:
    """``address``: the router's gRPC ``host:port`` (also asked for the model);
    ``http_url``: its OpenAI base URL, needed for the ``http`` backend."""
    if isinstance(options.workload, MultiTurnWorkload):
        return await _measure_conversations(address, options, progress)
    assert isinstance(options.workload, Workload)
    info = await model_info(address, token=options.api_key)
    requests = build_requests(
        options.workload,
        info.vocab_size,
        excluded_ids=info.eos_token_ids,
        num_warmup=options.num_warmup,
        duration_s=options.duration_s,
        prompt_stream=options.prompt_stream,
    )
    longest = max(r.num_prompt_tokens + r.max_tokens for r in requests)
    if longest > info.max_model_len:
        raise ValueError(
            f"a request needs {longest} tokens; {info.name} serves at most {info.max_model_len}"
        )
    client: Client
    if options.backend == "http":
        if not http_url:
            raise ValueError("the http backend needs the router's HTTP URL (--http)")
        client = HttpClient(http_url, options.timeout_s, options.api_key)
    else:
        client = GrpcClient(address, options.timeout_s, options.api_key)
    try:
        outcome = await run_open_loop(
            client, requests, max_concurrency=options.max_concurrency, progress=progress
        )
    finally:
        await client.close()
    return outcome, summarize(outcome.results, options.slos, cap_hits=outcome.cap_hits)


async def _measure_conversations(
    address: str, options: BenchOptions, progress: TextIO | None
) -> tuple[RunOutcome, dict[str, Any]]:
    from orchestrator.loadgen.conversations import measure_conversations

    assert isinstance(options.workload, MultiTurnWorkload)
    start = time.perf_counter()
    turns, summary = await measure_conversations(
        address,
        options.workload,
        options.slos,
        num_warmup=options.num_warmup,
        timeout_s=options.timeout_s,
        api_key=options.api_key,
        progress=progress,
    )
    wall_s = time.perf_counter() - start
    # At most one turn per conversation is in flight: the cap is never reached.
    results = [t.result for t in turns]
    return RunOutcome("grpc", results, 0, options.max_concurrency, wall_s), summary
