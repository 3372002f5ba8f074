"""The colocated (mixed) instance: chunked prefill and decode share every step.

Each step runs one token of every running sequence, then fills the rest of the token budget
with prefill chunks in admission order (each but a prompt's last ends on a page boundary:
`instances.chunk_tokens`); the step that completes a prompt yields its first token. The whole step costs one pass over all its tokens, so a chunk in the batch slows
every decoding sequence of that step (docs/design.md §1): that stall is what this models.
"""

from __future__ import annotations

from collections import deque

from orchestrator.sim.cost import CostModel, StepShape
from orchestrator.sim.instances import (
    DecodeSet,
    EngineLimits,
    InstanceBase,
    SimRequest,
    chunk_tokens,
    request_tokens,
)


class MixedInstance(InstanceBase):
    role = "mixed"

    def __init__(self, cost: CostModel, tp: int, limits: EngineLimits) -> None:
        super().__init__(cost, tp, limits)
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []
        self.running = DecodeSet()
        self.step = 0
        self._base_of: dict[int, tuple[int, int]] = {}
        self._chunks: list[tuple[SimRequest, int]] = []
        self.itl_steps: list[tuple[float, int]] = []

    def start_step(self, now: float) -> float | None:
        while self.waiting and self._admits(
            self.waiting[0], len(self.running) + len(self.prefilling)
        ):
            request = self.waiting.popleft()
            self.num_reserved_tokens += request_tokens(request)
            self.prefilling.append(request)
        num_decodes = len(self.running)
        budget = max(0, self.limits.max_num_batched_tokens - num_decodes)
        tokens, attention, self._chunks = 0, 0, []
        for request in self.prefilling:
            if budget == 0:
                break
            left = request.spec.num_prompt_tokens - request.num_prefilled
            take = chunk_tokens(request.num_prefilled, left, budget, self.limits.page_size)
            if not take:
                continue
            attention += take * request.num_prefilled + take * (take + 1) // 2
            tokens, budget = tokens + take, budget - take
            self._chunks.append((request, take))
            if request.prefill_start_time is None:
                request.prefill_start_time = now
        if not tokens and not num_decodes:
            return None
        kv = self.running.kv_tokens(self.step) + num_decodes
        shape = StepShape(tokens, attention, num_decodes, kv)
        duration = self._price(shape)
        # Every running sequence emitted its first token at the end of its last prefill step.
        self.itl_steps.append((duration, num_decodes))
        self.is_busy, self.busy_seconds = True, self.busy_seconds + duration
        return duration

    def finish_step(self, now: float, duration: float) -> list[SimRequest]:
        """Requests that finished with this step."""
        done = self.running.pop_finished(self.step, self._base_of)
        for request, take in self._chunks:
            request.num_prefilled += take
            request.prefill_seconds += duration
            if request.num_prefilled < request.spec.num_prompt_tokens:
                continue
            self.prefilling.remove(request)
            request.prefill_end_time = request.kv_ready_time = request.first_token_time = now
            request.first_token_step = self.step
            if request.spec.num_output_tokens == 1:
                done.append(request)
                continue
            # From the next step on it decodes: token i + 1 reads prompt + i positions.
            base, join = request.spec.num_prompt_tokens, self.step + 1
            self._base_of[request.spec.request_id] = (base, join)
            self.running.join(request, join, base, request.spec.num_output_tokens - 1)
        for request in done:
            request.finish_time, request.last_step = now, self.step
            self.num_reserved_tokens -= request_tokens(request)
        self.step += 1
        self.is_busy, self._chunks = False, []
        return done
