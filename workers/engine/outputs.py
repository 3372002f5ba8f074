"""What ``EngineCore.step`` reports, and the engine's run-time counters."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestOutput:
    """New tokens of one request in one step (deltas, not cumulative).

    finish_reason: ``stop`` | ``length`` | ``abort`` | ``prefilled`` (prefill role: the KV of all
    prompt tokens but the last is in ``page_ids``, held until ``EngineCore.release``).
    token_times: ``time.perf_counter()`` when each new token was sampled.
    """

    request_id: str
    new_token_ids: list[int]
    token_times: list[float]
    logprobs: list[float] | None = None
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    page_ids: tuple[int, ...] = ()


@dataclass
class EngineStats:
    """Counters measured while running (never written back into the config)."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_model_tokens: int = 0  # tokens run through the model (prefill chunks + decodes)
    # The prompt positions among them: a prompt recomputed after preemption counts again; a
    # decoder computes one per request (the last prompt token), a prefill worker the others.
    num_computed_prompt_tokens: int = 0
    num_sampled_tokens: int = 0  # never on the prefill role
    # Speculative decoding (vLLM's names): drafts verified, drafts kept, and kept per draft
    # position (index i: drafts at position i + 1 after the last sampled token).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # Prefix caching: tokens of admitted sequences looked up, and found in cached pages.
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    max_step_tokens: int = 0
