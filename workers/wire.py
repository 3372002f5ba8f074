"""What the router and a worker both speak on ``pdserve.v1.Worker``: the token deltas, request
ids, load reports and sampling parameters, with their protobuf conversions.

A neutral module: the router (`orchestrator.router`) and the worker server (`workers.service`)
import it, and it imports neither, so neither side reaches into the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from protos.pdserve.v1 import worker_pb2 as wpb
from workers.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one request; ``error`` is set with ``finish_reason == "error"``."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None


def worker_request_id(request_id: str, attempt: int) -> str:
    """The id a worker knows attempt ``attempt`` (router-unique) of client request
    ``request_id`` by."""
    return f"{request_id}#{attempt}"


def client_request_id(worker_request: str) -> str:
    """The client's id in a `worker_request_id` (client ids may contain ``#`` themselves)."""
    return worker_request.rpartition("#")[0]


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load now, and two counters since its engine started (`EngineStats`):
    ``num_computed_prompt_tokens`` (prompt tokens run through the model, recomputation
    included) and ``num_sampled_tokens`` (tokens sampled; 0 on the prefill role). The
    controller keeps each worker's last one in its `WorkerRecord` (all 0 until reported)."""

    num_running_requests: int = 0
    num_waiting_requests: int = 0
    num_free_kv_pages: int = 0
    num_total_kv_pages: int = 0
    num_transfers_in_flight: int = 0
    num_computed_prompt_tokens: int = 0
    num_sampled_tokens: int = 0
    num_prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    num_prefix_cache_hits: int = 0  # of them, found cached (not computed)
    num_spec_draft_tokens: int = 0  # speculative decoding: draft tokens verified
    num_spec_accepted_tokens: int = 0  # of them, kept
    num_spec_accepted_per_pos: tuple[int, ...] = ()  # kept, by draft position
    num_unauthenticated_messages: int = 0  # KV control messages refused for their MAC
    num_kv_pages_written: int = 0  # decoder: prompt KV pages asked of prefill workers
    num_kv_pages_skipped: int = 0  # decoder: prompt KV pages held in its prefix cache


@dataclass(frozen=True)
class CacheNaming:
    """How a worker names the pages of its prefix cache (`workers.engine.prefix_cache`): the
    chain's root and the tokens per page. A router that names a prompt's pages the same way can
    match them against the names the worker publishes."""

    salt: bytes
    page_size: int


def sampling_from_proto(message: wpb.WorkerSamplingParams) -> SamplingParams:
    """Raises `InvalidRequestError` for values the engine refuses."""
    return SamplingParams(
        temperature=message.temperature,
        top_p=message.top_p,
        top_k=message.top_k,
        min_p=message.min_p,
        repetition_penalty=message.repetition_penalty,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        max_tokens=message.max_tokens,
        stop=list(message.stop),
        stop_token_ids=list(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        seed=message.seed if message.HasField("seed") else None,
        logprobs=message.logprobs,
    )


def sampling_to_proto(params: SamplingParams) -> wpb.WorkerSamplingParams:
    message = wpb.WorkerSamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        max_tokens=params.max_tokens,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
    )
    if params.seed is not None:
        message.seed = params.seed
    return message
