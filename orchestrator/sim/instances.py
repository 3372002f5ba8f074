"""The simulated instances (one TP group each) and the request state they share.

Life cycle of a request (keyed by ``request_id``):

- disaggregated: router -> prefill queue (FIFO, chunked under the token budget; prefill
  covers every prompt token but the last) -> KV transfer (only the exposed part of the
  layer-wise push delays it) -> decode waiting queue -> decode running set (continuous
  batching; its first step runs the last prompt token and yields the first output token).
- mixed: router -> waiting -> prefilling (chunks share each step with every running decode;
  the step that finishes the prompt yields the first token) -> running.

Admission to a running set needs a free sequence slot and KV room for the whole request
(prompt + output): the simulator reserves up front instead of modelling preemption.
Instances are driven by `simulator.Simulator`: `start_step` plans a step and returns its
duration (None when idle; priced with ``busy_others``, the other instances in a step at that
moment, which the simulator sets), `finish_step` applies it at its end time.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from orchestrator.sim.cost import CostModel, StepShape
from orchestrator.sim.noise import NO_NOISE
from orchestrator.sim.workload import RequestSpec


@dataclass(frozen=True)
class EngineLimits:
    """Per-instance batch shape, as `orchestrator.config.sections.Limits` (same defaults).

    kv_capacity_tokens: KV tokens one instance holds (a served config's pool); None: the cost
    model's ``kv_capacity_tokens(tp)``.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_capacity_tokens: int | None = None
    page_size: int = 16  # a prompt's chunks but its last end on a page boundary, as served

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


def chunk_tokens(done: int, left: int, budget: int, page_size: int) -> int:
    """Prompt tokens a step runs of a prompt with ``done`` computed and ``left`` to go, within
    ``budget``: all that are left if they fit, else up to the last page boundary in reach, as
    the engine's scheduler chunks (`workers.engine.scheduler`). With decodes in a step, a
    budget of 256 gives a chunk of 240 on 16-token pages, not 253-255."""
    if left <= budget:
        return left
    return max((done + budget) // page_size * page_size - done, 0)


class SimRequest:
    """Mutable state of one request inside a run (the simulator's, never shared)."""

    __slots__ = (
        "decode_index",
        "finish_time",
        "first_token_step",
        "first_token_time",
        "kv_ready_time",
        "last_step",
        "num_prefilled",
        "prefill_end_time",
        "prefill_seconds",
        "prefill_start_time",
        "spec",
    )

    def __init__(self, spec: RequestSpec) -> None:
        self.spec = spec
        self.decode_index = -1
        self.num_prefilled = 0
        self.prefill_seconds = 0.0  # compute time of the passes that ran its chunks
        self.prefill_start_time: float | None = None
        self.prefill_end_time: float | None = None
        self.kv_ready_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        # Step indices (of its decode / mixed instance) of its first and last output token.
        self.first_token_step = -1
        self.last_step = -1


class DecodeSet:
    """Sequences decoding one token per step, in O(log n) per join / finish.

    A sequence joined at step j with base context c reads c + (s - j) KV tokens at step s, so
    the set's total is sum(c) + n * s - sum(j), kept as two running sums.
    """

    def __init__(self) -> None:
        self._last_steps: list[tuple[int, int, SimRequest]] = []  # (last step, id, request)
        self._sum_base = 0
        self._sum_join = 0

    def __len__(self) -> int:
        return len(self._last_steps)

    def join(self, request: SimRequest, step: int, base_context: int, num_tokens: int) -> None:
        heapq.heappush(self._last_steps, (step + num_tokens - 1, request.spec.request_id, request))
        self._sum_base += base_context
        self._sum_join += step

    def kv_tokens(self, step: int) -> int:
        return self._sum_base + len(self._last_steps) * step - self._sum_join

    def pop_finished(self, step: int, base_of: dict[int, tuple[int, int]]) -> list[SimRequest]:
        done = []
        while self._last_steps and self._last_steps[0][0] == step:
            _, request_id, request = heapq.heappop(self._last_steps)
            base, join = base_of.pop(request_id)
            self._sum_base -= base
            self._sum_join -= join
            done.append(request)
        return done


def request_tokens(request: SimRequest) -> int:
    return request.spec.num_prompt_tokens + request.spec.num_output_tokens


class InstanceBase:
    role = ""  # the worker role it stands for: what a cost model fitted per role prices

    def __init__(self, cost: CostModel, tp: int, limits: EngineLimits) -> None:
        self.cost, self.tp, self.limits = cost, tp, limits
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
        self.busy_others = 0  # other instances in a step when this one starts one (simulator)

    def _price(self, shape: StepShape) -> float:
        seconds = self.cost.step_seconds(shape, self.tp, self.busy_others, self.role)
        return self.noise.apply(self.role, shape, seconds)

    def _admits(self, request: SimRequest, num_admitted: int) -> bool:
        return (
            num_admitted < self.limits.max_num_seqs
            and self.num_reserved_tokens + request_tokens(request) <= self.capacity
        )


class PrefillInstance(InstanceBase):
    role = "prefill"

    def __init__(self, cost: CostModel, tp: int, limits: EngineLimits) -> None:
        super().__init__(cost, tp, limits)
        self.queue: deque[SimRequest] = deque()
        self.num_queued_tokens = 0
        self._chunks: list[tuple[SimRequest, int]] = []

    def add(self, request: SimRequest) -> None:
        self.queue.append(request)
        self.num_queued_tokens += request.spec.num_prompt_tokens - 1

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
        duration = self._price(StepShape(tokens, attention))
        self.is_busy, self.busy_seconds = True, self.busy_seconds + duration
        return duration

    def finish_step(self, now: float, duration: float) -> list[SimRequest]:
        """Requests whose prefill ended with this step, in queue order."""
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
        self.is_busy, self._chunks = False, []
        return done


class DecodeInstance(InstanceBase):
    role = "decode"

    def __init__(self, cost: CostModel, tp: int, limits: EngineLimits) -> None:
        super().__init__(cost, tp, limits)
        self.waiting: deque[SimRequest] = deque()
        self.running = DecodeSet()
        self.step = 0
        self._base_of: dict[int, tuple[int, int]] = {}
        self._joined: list[SimRequest] = []
        # ITL samples: per step, (duration, sequences that had emitted a token before it).
        self.itl_steps: list[tuple[float, int]] = []

    def start_step(self, now: float) -> float | None:
        self._joined = []
        while self.waiting and self._admits(self.waiting[0], len(self.running)):
            request = self.waiting.popleft()
            self.num_reserved_tokens += request_tokens(request)
            # The first step runs the last prompt token over the other prompt tokens' KV.
            base = request.spec.num_prompt_tokens - 1
            self._base_of[request.spec.request_id] = (base, self.step)
            self.running.join(request, self.step, base, request.spec.num_output_tokens)
            self._joined.append(request)
        if not len(self.running):
            return None
        # Each sequence also attends to the token it feeds in this step.
        kv = self.running.kv_tokens(self.step) + len(self.running)
        shape = StepShape(num_decode_seqs=len(self.running), num_decode_kv_tokens=kv)
        duration = self._price(shape)
        self.itl_steps.append((duration, len(self.running) - len(self._joined)))
        self.is_busy, self.busy_seconds = True, self.busy_seconds + duration
        return duration

    def finish_step(self, now: float, duration: float) -> list[SimRequest]:
        """Requests that finished with this step."""
        for request in self._joined:
            request.first_token_time, request.first_token_step = now, self.step
        done = self.running.pop_finished(self.step, self._base_of)
        for request in done:
            request.finish_time, request.last_step = now, self.step
            self.num_reserved_tokens -= request_tokens(request)
        self.step += 1
        self.is_busy = False
        return done
