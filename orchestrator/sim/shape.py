"""`StepShape`: what one forward pass of one instance processes, the unit every cost model
prices and the step-time noise is drawn for."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepShape:
    """What one forward pass of one instance processes.

    num_prefill_tokens: prompt tokens of the chunks in this step.
    num_prefill_attention: sum over those tokens of the positions each attends to (its chunk's
        earlier context plus the causal part of the chunk): the attention work of prefill.
    num_decode_seqs: sequences decoding one token each.
    num_decode_kv_tokens: KV tokens those sequences read (their whole contexts).
    """

    num_prefill_tokens: int = 0
    num_prefill_attention: int = 0
    num_decode_seqs: int = 0
    num_decode_kv_tokens: int = 0

    def __post_init__(self) -> None:
        if min(self.num_prefill_tokens, self.num_prefill_attention) < 0:
            raise ValueError(f"negative prefill work: {self}")
        if min(self.num_decode_seqs, self.num_decode_kv_tokens) < 0:
            raise ValueError(f"negative decode work: {self}")
        if self.num_tokens == 0:
            raise ValueError("an empty step has no cost")

    @property
    def num_tokens(self) -> int:
        """Tokens through the dense layers: what dominates a pass (docs/design.md §1)."""
        return self.num_prefill_tokens + self.num_decode_seqs
