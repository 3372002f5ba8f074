"""Speculative decoding: draft tokens proposed cheaply, verified by the target model in one step.

A decoding sequence with ``k`` drafts runs ``1 + k`` tokens in one step (its last sampled token,
then the drafts), over the paged cache like a short prefill chunk; the step returns logits for all
``1 + k`` positions. Verification samples each position with the ordinary sampler (penalties,
temperature, top-k/p/min-p, the request's seed) as if the drafts before it were accepted, and
keeps drafts while each equals the token sampled at its position; the first sample that differs
(or, when every draft is kept, the sample after the last) is the step's extra token. So a step
emits between 1 and ``k + 1`` tokens.

Why this is lossless: the drafts are deterministic (one proposal per position), and for a
deterministic proposal ``d`` "draw ``x ~ p``, keep ``d`` iff ``x == d``, else emit ``x``" is the
standard rejection rule (accept with probability ``p(d)``; on rejection draw from ``p`` without
``d``, renormalised), written as one draw. Every emitted token is therefore a draw from the
target distribution given the tokens before it; greedy decoding emits exactly the tokens
decoding without speculation would.

A sequence whose drafts keep failing (open-ended text that copies nothing) backs off: after a
step that kept no draft it skips proposing for 1, then 2, 4 ... up to `MAX_SPEC_BACKOFF` steps,
and drafts every step again once one is kept. Verifying ``k`` drafts costs ``k`` more rows per
step, and a multi-token step takes attention's slower chunk path.

The KV written for rejected drafts is rolled back: the sequence's computed count goes back to
its last kept position (those slots are rewritten by the next step) and pages no token needs
any more return to the pool.

Proposers: ``ngram`` (prompt lookup: the longest recent n-gram of the sequence found earlier in
it proposes what followed there; no model, gains on extractive and editing work); ``mtp``
(DeepSeek-V3's multi-token-prediction module, `workers.engine.mtp_drafter`: the first draft
from the module, more by chaining it; on a decoder the first from the hidden state the prefill
ships); ``draft_model`` (a smaller
checkpoint with the same tokenizer, its own paged KV, `workers.engine.draft_model`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "mtp", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
# Longest pause (steps) of a sequence's drafting after verifications that kept nothing.
MAX_SPEC_BACKOFF = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: the proposer; ``num_speculative_tokens``: drafts per step (k);
    ``prompt_lookup_min`` / ``prompt_lookup_max``: n-gram lengths ngram tries, longest first;
    ``model``: the draft checkpoint's directory (``draft_model`` only)."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("the draft_model method needs a model (and only it takes one)")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpeculativeConfig:
        """From a config mapping (``LLM(speculative_config=...)``, a group's ``speculative``);
        unknown keys are an error, not silently dropped."""
        known = {
            "method",
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "model",
        }
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown speculative option(s) {unknown}; known: {sorted(known)}")
        return cls(**raw)


def propose_ngram(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the sequence's last
    ``n`` tokens, for the largest ``n`` in ``max_n .. min_n`` that occurs; [] when none does."""
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = list(token_ids[length - n :])
        # Latest match first: recent context predicts best. A match must leave at least one
        # token after it, before the suffix itself.
        for start in range(length - n - 1, -1, -1):
            if list(token_ids[start : start + n]) == suffix:
                return list(token_ids[start + n : start + n + k])
    return []


def accepted_prefix(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many drafts verification keeps: ``sampled[i]`` is the target's token at draft ``i``'s
    position (given the drafts before it), and drafts are kept while they equal it."""
    kept = 0
    for draft, token in zip(drafts, sampled, strict=False):
        if draft != token:
            break
        kept += 1
    return kept
