"""Speculative decoding in the simulator: the acceptance profile and the draws made from it.

The engine (`workers.engine.speculative`) gives a decoding sequence up to ``k`` drafts per
step, verifies them in the same pass as its newest token and keeps drafts while each equals
the target's token at its position; the first that differs ends the run. A draft at position
``i`` is therefore kept only if every draft before it was, and the profile is the chain of
conditional probabilities ``acceptance[i] = P(draft i kept | drafts 0..i-1 kept)`` (what the
engine's counters give: `spec_profile`). A step emits ``1 + kept`` tokens.

Draws are per request and per verification, from a generator seeded by the simulation's seed
and the request id: the same request keeps the same draws in every layout and at every rate
of a plan, and a run is repeatable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from workers.engine.speculative import MAX_SPEC_BACKOFF, MAX_SPECULATIVE_TOKENS

SpecMethod = Literal["mtp", "ngram"]
SPEC_METHODS: tuple[SpecMethod, ...] = ("mtp", "ngram")
_DRAW_STREAM = 0x5BEC  # keeps the acceptance draws apart from other uses of the seed

__all__ = ["MAX_SPEC_BACKOFF", "SPEC_METHODS", "SpecDecoding", "SpecMethod"]


@dataclass(frozen=True)
class SpecDecoding:
    """``acceptance``: per draft position, the chance it is kept given the drafts before it
    were; ``k`` is its length. ``method``: ``mtp`` drafts with the model's MTP module, priced
    as its passes (`shape.StepShape.num_mtp_tokens`); ``ngram`` drafts by prompt lookup,
    which costs no forward pass."""

    acceptance: tuple[float, ...]
    method: SpecMethod = "mtp"

    def __post_init__(self) -> None:
        if not 1 <= len(self.acceptance) <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"drafts per step (k) must be in 1..{MAX_SPECULATIVE_TOKENS}, "
                f"got {len(self.acceptance)}"
            )
        for position, value in enumerate(self.acceptance):
            if not (math.isfinite(value) and 0.0 <= value <= 1.0):
                raise ValueError(
                    f"acceptance at draft position {position} must be in [0, 1], got {value}"
                )
        if self.method not in SPEC_METHODS:
            raise ValueError(f"draft method must be one of {SPEC_METHODS}, got {self.method!r}")

    @property
    def k(self) -> int:
        return len(self.acceptance)

    def expected_kept(self) -> float:
        """Mean drafts kept per verification of all ``k``: sum over i of P(drafts 0..i kept)."""
        return float(np.cumprod(self.acceptance).sum())

    def expected_tokens_per_step(self) -> float:
        return 1.0 + self.expected_kept()

    def draws(self, seed: int, request_id: int, count: int) -> np.ndarray:
        """Drafts kept at each of a request's first ``count`` verifications of all ``k``
        drafts; a verification of fewer keeps ``min(draw, drafts)`` (the chain's prefix)."""
        rng = np.random.default_rng([seed, _DRAW_STREAM, request_id])
        kept = rng.random((count, self.k)) < np.asarray(self.acceptance)
        return np.cumprod(kept, axis=1).sum(axis=1)

    def label(self) -> str:
        values = ",".join(f"{a:g}" for a in self.acceptance)
        return f"{self.method} k={self.k}, acceptance {values}"
