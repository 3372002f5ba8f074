"""The colocated (mixed) instance: chunked prefill and decode share every step.

Each step runs every running sequence's decode rows (its newest token, and its drafts with
speculative decoding), then fills the rest of the token budget with prefill chunks in
admission order (each but a prompt's last ends on a page boundary: `instances.chunk_tokens`);
the step that completes a prompt yields its first token. A prompt starts after the tokens its
conversation left in this instance's prefix cache (`caching`; the last prompt token is always
computed, to sample). The whole step costs one pass over all its tokens, so a chunk in the
batch slows every decoding sequence of that step (docs/design.md §1): that stall is what this
models.
"""

from __future__ import annotations

from collections import deque

from orchestrator.sim.cost import CostModel
from orchestrator.sim.instances import (
    EngineLimits,
    InstanceBase,
    SimRequest,
    chunk_tokens,
    decode_shape,
    request_tokens,
)
from orchestrator.sim.options import ServingOptions


class MixedInstance(InstanceBase):
    role = "mixed"

    def __init__(
        self,
        cost: CostModel,
        tp: int,
        limits: EngineLimits,
        options: ServingOptions | None = None,
    ) -> None:
        super().__init__(cost, tp, limits, options)
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []
        self.running = self._new_decode_batch()
        self.step = 0
        self._chunks: list[tuple[SimRequest, int]] = []
        self.itl_steps: list[tuple[float, int]] = []
        self._num_gaps = 0  # of the step in progress

    def cached_tokens(self, request: SimRequest) -> int:
        """Prompt tokens found cached here (all but the last, which is computed to sample)."""
        return self.cache.hit(request.spec, request.spec.num_prompt_tokens - 1)

    def has_prompt_work(self) -> bool:
        return bool(self.waiting or self.prefilling)

    def start_step(self, now: float) -> float | None:
        while self.waiting and self._admits(
            self.waiting[0], len(self.running) + len(self.prefilling)
        ):
            request = self.waiting.popleft()
            cached = self.cached_tokens(request)
            self.cache.take(request.spec)
            request.num_prefilled = request.num_cached_tokens = cached
            self.num_reserved_tokens += request_tokens(request)
            self.cache.fit(self.free_tokens)
            self.prefilling.append(request)
        num_decodes = len(self.running)
        work = self.running.plan(self.step, self.limits.max_num_batched_tokens)
        budget = max(0, self.limits.max_num_batched_tokens - work.num_tokens)
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
        if tokens and self.options.mtp:
            # The module's pass after the step covers the chunks' positions too.
            work = work._replace(
                num_mtp_tokens=work.num_mtp_tokens + tokens,
                num_mtp_passes=max(1, work.num_mtp_passes),
            )
        # Every running sequence emitted its first token at the end of its last prefill step.
        self._num_gaps = num_decodes
        self.is_busy = True
        return self._price(decode_shape(work, tokens, attention))

    def finish_step(self, now: float, duration: float) -> list[SimRequest]:
        """Requests that finished with this step."""
        self.itl_steps.append((self._gap(now, duration), self._num_gaps))
        self.busy_seconds += duration
        done = self.running.finish(self.step)
        for request, take in self._chunks:
            request.num_prefilled += take
            request.prefill_seconds += duration
            if request.num_prefilled < request.spec.num_prompt_tokens:
                continue
            self.prefilling.remove(request)
            request.prefill_end_time = request.kv_ready_time = request.first_token_time = now
            request.first_token_step = self.step
            if self.options.speculative is not None:
                request.emitted = [1]  # the first token, sampled at the prompt's end
            if request.spec.num_output_tokens == 1:
                done.append(request)
                continue
            # From the next step on it decodes: token i + 1 reads prompt + i positions.
            base, join = request.spec.num_prompt_tokens, self.step + 1
            self.running.join(request, join, base, request.spec.num_output_tokens - 1)
        for request in done:
            request.finish_time, request.last_step = now, self.step
            self.num_reserved_tokens -= request_tokens(request)
            self.cache.keep(request.spec, request_tokens(request) - 1, self.free_tokens)
        self.step += 1
        self.is_busy, self._chunks = False, []
        return done
