"""`StepShape`: what one forward pass of one instance processes, the unit every cost model
prices and the step-time noise is drawn for."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class StepShape:
    """What one forward pass of one instance processes.

    num_prefill_tokens: prompt tokens of the chunks in this step.
    num_prefill_attention: sum over those tokens of the positions each attends to (its chunk's
        earlier context plus the causal part of the chunk): the attention work of prefill.
    num_decode_seqs: sequences decoding in this step (each runs at least its newest token).
    num_decode_kv_tokens: KV tokens those sequences read (their whole contexts), once each.

    Speculative decoding (`speculative`): a decoding sequence with drafts runs them after its
    newest token in the same pass, and the model's MTP module proposes the next drafts:

    num_draft_tokens: draft tokens verified, beyond each decode sequence's one token: they go
        through every layer like it (the pass runs ``num_decode_seqs + num_draft_tokens``
        decode rows), and read the same contexts, which the decode sequences already count.
    num_draft_attention: sum over the drafts of the positions each attends to (its sequence's
        context, the newest token and the drafts before it): attention FLOPs, not KV bytes.
    num_mtp_tokens: positions the MTP module runs over in this step (one decoder layer, a
        projection and the output head per position); 0 for drafts that cost no pass (n-gram).
    num_mtp_passes: module passes that run one after another (the pass over the step's kept
        positions, then one per further chained draft): each reads the module's weights.
    """

    num_prefill_tokens: int = 0
    num_prefill_attention: int = 0
    num_decode_seqs: int = 0
    num_decode_kv_tokens: int = 0
    num_draft_tokens: int = 0
    num_draft_attention: int = 0
    num_mtp_tokens: int = 0
    num_mtp_passes: int = 0

    def __post_init__(self) -> None:
        negative = [f.name for f in fields(self) if getattr(self, f.name) < 0]
        if negative:
            raise ValueError(f"negative work ({', '.join(negative)}): {self}")
        if self.num_draft_tokens and not self.num_decode_seqs:
            raise ValueError(f"drafts without a decoding sequence to verify them: {self}")
        if bool(self.num_mtp_tokens) != bool(self.num_mtp_passes):
            raise ValueError(f"MTP positions and passes go together: {self}")
        if self.num_tokens == 0:
            raise ValueError("an empty step has no cost")

    @property
    def num_tokens(self) -> int:
        """Tokens through the dense layers: what dominates a pass (docs/design.md §1)."""
        return self.num_prefill_tokens + self.num_decode_seqs + self.num_draft_tokens
