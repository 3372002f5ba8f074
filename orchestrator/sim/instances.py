"""The simulated instances (one TP group each) and the request state they share.

Life cycle of a request (keyed by ``request_id``):

- disaggregated: router -> prefill queue (FIFO, chunked under the token budget; prefill
  covers every prompt token but the last) -> KV transfer (only the exposed part of the
  layer-wise push delays it) -> decode waiting queue -> decode running set (continuous
  batching; its first step runs the last prompt token and yields the first output token).
- mixed: router -> waiting -> prefilling (chunks share each step with every running decode;
  the step that finishes the prompt yields the first token) -> running.

Admission to a running set needs a free sequence slot and KV room for the whole request
(prompt + output): the simulator reserves up front instead of modelling preemption. With
prefix caching (`caching`) a prefill (or mixed) instance starts a prompt after the tokens it
finds cached, and a decoder is pushed only the prompt pages it does not hold; cached pages
live in the KV the reservations leave free. With speculative decoding (`options`) a running
set is a `spec_batch.SpecDecodeSet`: sequences verify drafts and emit one or more tokens.
Instances are driven by `simulator.Simulator`: `start_step` plans a step and returns its
price (None when idle; priced with ``busy_other_roles``, the other instances in a step at that
moment, which the simulator sets), `finish_step` applies it at its end time with the seconds
it took (its price, unless the simulator re-divides shared cores while it runs).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from orchestrator.sim.batch import (
    DecodeBatch,
    DecodeSet,
    DecodeWork,
    SimRequest,
    request_tokens,
)
from orchestrator.sim.caching import PrefixCache
from orchestrator.sim.cost import CostModel, StepShape
from orchestrator.sim.noise import NO_NOISE
from orchestrator.sim.options import ServingOptions
from orchestrator.sim.spec_batch import SpecDecodeSet

__all__ = [
    "DecodeInstance",
    "DecodeSet",
    "EngineLimits",
    "InstanceBase",
    "PrefillInstance",
    "SimRequest",
    "chunk_tokens",
    "decode_shape",
    "request_tokens",
]


@dataclass(frozen=True)
class EngineLimits:
    """Per-instance batch shape, as `orchestrator.config.sections.Limits` (same defaults).

    kv_capacity_tokens: KV tokens one instance holds (a served config's pool); None: the cost
    model's ``kv_capacity_tokens(tp)``.
    min_step_interval_s: a step with no prompt work starts at least this long after the
    previous one started (`workers.engine.step_loop`'s pacing); 0: at once.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_capacity_tokens: int | None = None
    page_size: int = 16  # a prompt's chunks but its last end on a page boundary, as served
    min_step_interval_s: float = 0.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.page_size < 1:
            raise ValueError(f"limits must be >= 1, got {self}")
        if self.max_num_batched_tokens < self.page_size:
            # A chunk could never reach a page boundary: the prompt would never advance.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"page_size ({self.page_size})"
            )
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < 1:
            raise ValueError(f"kv_capacity_tokens must be >= 1, got {self.kv_capacity_tokens}")
        if not 0.0 <= self.min_step_interval_s < float("inf"):  # also refuses NaN
            raise ValueError(f"min_step_interval_s must be >= 0, got {self.min_step_interval_s}")


def chunk_tokens(done: int, left: int, budget: int, page_size: int) -> int:
    """Prompt tokens a step runs of a prompt with ``done`` computed and ``left`` to go, within
    ``budget``: all that are left if they fit, else up to the last page boundary in reach, as
    the engine's scheduler chunks (`workers.engine.scheduler`). With decodes in a step, a
    budget of 256 gives a chunk of 240 on 16-token pages, not 253-255."""
    if left <= budget:
        return left
    return max((done + budget) // page_size * page_size - done, 0)


def decode_shape(
    work: DecodeWork, prefill_tokens: int = 0, prefill_attention: int = 0
) -> StepShape:
    """A step's shape: its prefill chunks and its decode work."""
    return StepShape(
        prefill_tokens,
        prefill_attention,
        work.num_seqs,
        work.num_kv_tokens,
        work.num_draft_tokens,
        work.num_draft_attention,
        work.num_mtp_tokens,
        work.num_mtp_passes,
    )


class InstanceBase:
    role = ""  # the worker role it stands for: what a cost model fitted per role prices

    def __init__(
        self,
        cost: CostModel,
        tp: int,
        limits: EngineLimits,
        options: ServingOptions | None = None,
    ) -> None:
        self.cost, self.tp, self.limits = cost, tp, limits
        self.options = options or ServingOptions()
        self.cache = PrefixCache(limits.page_size, self.options.prefix_caching)
        self.noise = NO_NOISE  # the simulation's (`noise`), set by the simulator
        self.is_busy = False
        self.num_outstanding = 0  # requests routed here and not finished (router's load)
        self.busy_seconds = 0.0
        self.capacity = (
            cost.kv_capacity_tokens(tp)
            if limits.kv_capacity_tokens is None
            else limits.kv_capacity_tokens
        )
        self.num_reserved_tokens = 0  # KV of admitted requests, prompt + output
        # The roles of the other instances in a step when this one starts one (simulator).
        self.busy_other_roles: tuple[str, ...] = ()
        self.last_step_start = -math.inf
        self.pace_wake_at: float | None = None  # when the simulator will kick it (pacing)
        self._last_step_end: float | None = None

    def _gap(self, now: float, duration: float) -> float:
        """A step ending at ``now``: the gap its running sequences saw since their previous
        token, the step before's end. Its duration when the steps ran back to back; longer
        after a paced wait (an instance with running sequences idles for nothing else)."""
        gap = duration if self._last_step_end is None else now - self._last_step_end
        self._last_step_end = now
        return gap

    def has_prompt_work(self) -> bool:
        """Its next step would compute prompt tokens or admit a request: pacing never delays
        that step. Every prefill step does."""
        return True

    def paced_until(self, now: float) -> float | None:
        """When its next step may start, if that is later than ``now`` (pacing); else None."""
        interval = self.limits.min_step_interval_s
        if interval <= 0 or self.has_prompt_work():
            return None
        due = self.last_step_start + interval
        return due if due > now else None

    def _new_decode_batch(self) -> DecodeBatch:
        spec = self.options.speculative
        if spec is None:
            return DecodeSet()
        return SpecDecodeSet(spec, self.options.seed, self.options.mtp)

    @property
    def free_tokens(self) -> int:
        """KV tokens no admitted request holds: where cached pages live."""
        return self.capacity - self.num_reserved_tokens

    def _price(self, shape: StepShape) -> float:
        seconds = self.cost.step_seconds(shape, self.tp, self.busy_other_roles, self.role)
        return self.noise.apply(self.role, shape, seconds)

    def _admits(self, request: SimRequest, num_admitted: int) -> bool:
        return (
            num_admitted < self.limits.max_num_seqs
            and self.num_reserved_tokens + request_tokens(request) <= self.capacity
        )


class PrefillInstance(InstanceBase):
    role = "prefill"

    def __init__(
        self,
        cost: CostModel,
        tp: int,
        limits: EngineLimits,
        options: ServingOptions | None = None,
    ) -> None:
        super().__init__(cost, tp, limits, options)
        self.queue: deque[SimRequest] = deque()
        self.num_queued_tokens = 0  # prompt tokens to compute (cached ones left out)
        self._chunks: list[tuple[SimRequest, int]] = []

    def cached_tokens(self, request: SimRequest) -> int:
        """Of the prompt's KV (all but its last token), the tokens found cached here: the
        last prefilled token is always computed (its hidden state is the context write)."""
        return self.cache.hit(request.spec, request.spec.num_prompt_tokens - 2)

    def add(self, request: SimRequest) -> None:
        cached = self.cached_tokens(request)
        self.cache.take(request.spec)
        request.num_prefilled = request.num_cached_tokens = cached
        self.queue.append(request)
        self.num_queued_tokens += request.spec.num_prompt_tokens - 1 - cached

    def start_step(self, now: float) -> float | None:
        budget, tokens, attention = self.limits.max_num_batched_tokens, 0, 0
        self._chunks = []
        for request in self.queue:
            if budget == 0:
                break
            left = request.spec.num_prompt_tokens - 1 - request.num_prefilled
            take = chunk_tokens(request.num_prefilled, left, budget, self.limits.page_size)
            if not take:
                continue
            context = request.num_prefilled
            attention += take * context + take * (take + 1) // 2
            tokens += take
            budget -= take
            self._chunks.append((request, take))
            if request.prefill_start_time is None:
                request.prefill_start_time = now
        if not tokens:
            return None
        # Drafting with MTP, the decoders need the module's KV of the prompt: the prefill
        # runs the module over its tokens in the same pass (`workers.engine.mtp_drafter`).
        mtp = (tokens, 1) if self.options.mtp else (0, 0)
        self.is_busy = True
        return self._price(StepShape(tokens, attention, 0, 0, 0, 0, *mtp))

    def finish_step(self, now: float, duration: float) -> list[SimRequest]:
        """Requests whose prefill ended with this step, in queue order."""
        self.busy_seconds += duration
        done = []
        for request, take in self._chunks:
            request.num_prefilled += take
            request.prefill_seconds += duration
            self.num_queued_tokens -= take
            if request.num_prefilled == request.spec.num_prompt_tokens - 1:
                request.prefill_end_time = now
                done.append(request)
        for request in done:
            self.queue.remove(request)
            # Its pages go back to the pool once pushed, still named: cached.
            room = self.capacity - self.num_queued_tokens
            self.cache.keep(request.spec, request.spec.num_prompt_tokens - 1, room)
        self.is_busy, self._chunks = False, []
        return done


class DecodeInstance(InstanceBase):
    role = "decode"

    def __init__(
        self,
        cost: CostModel,
        tp: int,
        limits: EngineLimits,
        options: ServingOptions | None = None,
    ) -> None:
        super().__init__(cost, tp, limits, options)
        self.waiting: deque[SimRequest] = deque()
        self.running = self._new_decode_batch()
        self.step = 0
        self._joined: list[SimRequest] = []
        # ITL samples: per step, (duration, sequences that had emitted a token before it).
        self.itl_steps: list[tuple[float, int]] = []
        self._num_gaps = 0  # of the step in progress

    def has_prompt_work(self) -> bool:
        return bool(self.waiting)  # arrived KV to admit: its first token

    def start_step(self, now: float) -> float | None:
        self._joined = []
        while self.waiting and self._admits(self.waiting[0], len(self.running)):
            request = self.waiting.popleft()
            self.num_reserved_tokens += request_tokens(request)
            self.cache.fit(self.free_tokens)
            # The first step runs the last prompt token over the other prompt tokens' KV.
            base = request.spec.num_prompt_tokens - 1
            self.running.join(request, self.step, base, request.spec.num_output_tokens)
            self._joined.append(request)
        if not len(self.running):
            return None
        work = self.running.plan(self.step, self.limits.max_num_batched_tokens)
        self._num_gaps = len(self.running) - len(self._joined)
        self.is_busy = True
        return self._price(decode_shape(work))

    def finish_step(self, now: float, duration: float) -> list[SimRequest]:
        """Requests that finished with this step."""
        self.itl_steps.append((self._gap(now, duration), self._num_gaps))
        self.busy_seconds += duration
        for request in self._joined:
            request.first_token_time, request.first_token_step = now, self.step
        done = self.running.finish(self.step)
        for request in done:
            request.finish_time, request.last_step = now, self.step
            self.num_reserved_tokens -= request_tokens(request)
            # The prompt and every answer token but the last have KV: they stay cached.
            self.cache.keep(request.spec, request_tokens(request) - 1, self.free_tokens)
        self.step += 1
        self.is_busy = False
        return done
