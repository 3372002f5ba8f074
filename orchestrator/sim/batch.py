"""A request's state inside a run, and the running set of a decode or mixed instance.

A decode set plans each step's decode work (`DecodeWork`, the decode part of the step's
`shape.StepShape`) when the step starts and applies it when the step ends: `DecodeSet` for
sequences that emit one token per step, `spec_batch.SpecDecodeSet` for sequences that verify
drafts and emit one or more.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple, Protocol

from orchestrator.sim.workload import RequestSpec


class SimRequest:
    """Mutable state of one request inside a run (the simulator's, never shared)."""

    __slots__ = (
        "arrival_time",
        "decode_index",
        "emitted",
        "finish_time",
        "first_token_step",
        "first_token_time",
        "kv_ready_time",
        "last_step",
        "num_cached_tokens",
        "num_decoder_cached_tokens",
        "num_prefilled",
        "num_transferred_tokens",
        "prefill_end_time",
        "prefill_seconds",
        "prefill_start_time",
        "spec",
    )

    def __init__(self, spec: RequestSpec) -> None:
        self.spec = spec
        self.arrival_time = spec.arrival_time  # a later turn's: when its conversation sent it
        self.decode_index = -1
        self.num_prefilled = 0
        self.num_cached_tokens = 0  # prompt tokens its prefill found cached, not computed
        self.num_decoder_cached_tokens = 0  # prompt tokens its decoder held: not transferred
        self.num_transferred_tokens = 0  # prompt tokens whose KV was pushed to its decoder
        self.prefill_seconds = 0.0  # compute time of the passes that ran its chunks
        self.prefill_start_time: float | None = None
        self.prefill_end_time: float | None = None
        self.kv_ready_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        # Step indices (of its decode / mixed instance) of its first and last output token.
        self.first_token_step = -1
        self.last_step = -1
        # With drafts: tokens emitted at each step from its first token's on (None: one each).
        self.emitted: list[int] | None = None


def request_tokens(request: SimRequest) -> int:
    return request.spec.num_prompt_tokens + request.spec.num_output_tokens


class DecodeWork(NamedTuple):
    """The decode part of a step (`shape.StepShape`'s fields of the same names)."""

    num_seqs: int = 0
    num_kv_tokens: int = 0
    num_draft_tokens: int = 0
    num_draft_attention: int = 0
    num_mtp_tokens: int = 0
    num_mtp_passes: int = 0

    @property
    def num_tokens(self) -> int:
        """Rows of the pass, toward the step's token budget."""
        return self.num_seqs + self.num_draft_tokens


class DecodeBatch(Protocol):
    def __len__(self) -> int: ...

    def join(self, request: SimRequest, step: int, base_context: int, num_tokens: int) -> None:
        """``request`` decodes from ``step`` on, over ``base_context`` tokens of KV, until it
        has emitted ``num_tokens``."""
        ...

    def plan(self, step: int, budget: int) -> DecodeWork:
        """Step ``step``'s decode work, within ``budget`` rows (its sequences always run)."""
        ...

    def finish(self, step: int) -> list[SimRequest]:
        """Apply the planned step; the requests that emitted their last token in it."""
        ...


class DecodeSet:
    """Sequences decoding one token per step, in O(log n) per join / finish.

    A sequence joined at step j with base context c reads c + (s - j) KV tokens at step s, so
    the set's total is sum(c) + n * s - sum(j), kept as two running sums.
    """

    def __init__(self) -> None:
        self._last_steps: list[tuple[int, int, SimRequest]] = []  # (last step, id, request)
        self._base_of: dict[int, tuple[int, int]] = {}  # request id -> (base, join step)
        self._sum_base = 0
        self._sum_join = 0

    def __len__(self) -> int:
        return len(self._last_steps)

    def join(self, request: SimRequest, step: int, base_context: int, num_tokens: int) -> None:
        heapq.heappush(self._last_steps, (step + num_tokens - 1, request.spec.request_id, request))
        self._base_of[request.spec.request_id] = (base_context, step)
        self._sum_base += base_context
        self._sum_join += step

    def kv_tokens(self, step: int) -> int:
        return self._sum_base + len(self._last_steps) * step - self._sum_join

    def plan(self, step: int, budget: int) -> DecodeWork:
        # Each sequence also attends to the token it feeds in this step.
        return DecodeWork(len(self), self.kv_tokens(step) + len(self))

    def finish(self, step: int) -> list[SimRequest]:
        done = []
        while self._last_steps and self._last_steps[0][0] == step:
            _, request_id, request = heapq.heappop(self._last_steps)
            base, join = self._base_of.pop(request_id)
            self._sum_base -= base
            self._sum_join -= join
            done.append(request)
        return done
