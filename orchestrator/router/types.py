"""What goes into the router and what comes out of it: its settings (`RouterSettings`), a
client's request as the API front read it (`GenerationInput`) and the events of its stream
(`StreamEvent`, the last one with its `Timings`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchestrator.config.sections import DEFAULT_MAX_REQUEST_BYTES


@dataclass(frozen=True)
class RouterSettings:
    """What the router needs to know of the cluster (from `ClusterConfig`)."""

    serving_role: str  # "decode" or "mixed"
    is_disaggregated: bool
    vocab_size: int
    max_model_len: int
    pool_tokens: int  # KV tokens a serving worker holds when empty
    capacity_per_worker: int  # requests in flight per worker before the router queues
    max_queue: int
    default_max_tokens: int
    policy: str = "least_outstanding"
    seed: int | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # also bounds a prompt's UTF-8 bytes
    # A worker whose link broke is not chosen again until the controller replaced it (new
    # generation or address) or this long passed (a break that was not the worker's death).
    suspect_hold_seconds: float = 10.0
    # Other prefill workers a disaggregated request may try when its KV transfer failed before
    # any token was streamed (0: fail it at once).
    prefill_retries: int = 1
    # Other serving workers a request may try when its worker was lost (link broken, failed
    # health check, refused as unavailable) before any token was streamed (0: fail it at once).
    worker_retries: int = 1
    # Disaggregated: while no prefill worker is ready (or every one tried failed), the decoder
    # prefills the request itself (in its own steps, slowing its other requests' tokens)
    # rather than the request failing.
    local_prefill_fallback: bool = True
    # EOS ids whose text is not output (the engine's `StopChecker`: the model config's and the
    # tokenizer's); ``ignore_eos`` disables them.
    eos_token_ids: frozenset[int] = frozenset()
    # ``kv_aware``: weight of the share of a prompt a worker holds cached, and of its load
    # (outstanding requests / capacity_per_worker), in its score (`KVAwareWeights`).
    kv_cache_weight: float = 1.0
    kv_load_weight: float = 1.0


@dataclass(frozen=True)
class GenerationInput:
    """A client request after the servicer read it (sampling: `SamplingParams` fields the
    client set; max_tokens None means the router's default)."""

    request_id: str = ""
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None
    # OpenAI's rule (the HTTP front): an explicit max_tokens that the prompt leaves no room for
    # is refused (`ContextLengthError`). Else (gRPC) it is served and ends with "length" at
    # max_model_len.
    max_tokens_within_context: bool = False
    return_token_ids: bool = False
    return_logprobs: bool = False


@dataclass(frozen=True)
class Timings:
    time_to_first_token: float
    mean_inter_token_latency: float
    end_to_end_latency: float
    queue_time: float


@dataclass(frozen=True)
class StreamEvent:
    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str = ""
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    timings: Timings | None = None
    # With return_logprobs: where each of ``token_ids``' texts starts in the whole answer.
    text_offsets: list[int] = field(default_factory=list)
