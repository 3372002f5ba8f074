"""Discrete-event simulation of one pdserve cluster under one workload.

Events (time-ordered; ties by insertion): an arrival, the end of an instance's step, and a
request's KV becoming ready on its decoder. The router assigns each arrival to the decode
instance with the fewest outstanding requests and the prefill instance with the fewest
queued prompt tokens (mixed: the instance with the fewest outstanding requests); with
``kv_aware`` routing (`options.ServingOptions`), to the decoder whose prefix cache holds most
of the prompt, weighed against its load as the router weighs it, and to the prefill instance
with the least uncached work once this prompt is added. A conversation's later turn arrives
``think_time_s`` after its previous turn's last token (`conversations`). After every
event the instances it touched start a step if they are idle and have work; a decode-only step
of paced limits (`EngineLimits.min_step_interval_s`) waits until its interval has passed since
the instance's previous step started, as the engine's step loop paces it. A request reaches
the router `CostModel.request_overhead_seconds` after it arrives (the fixed costs outside engine
steps), so that delay is part of its TTFT and of nothing else's. A step is priced with the
other instances in a step when it starts, their count and roles, and keeps that price; with a
cost model of instances that share one machine's cores (`CostModel.shared_cores`) a step is
priced alone instead and runs at its share of the cores, re-divided whenever any instance's
step starts or ends (`shared_cores.ProcessorSharing`).

The transfer model: the KV push overlaps the prefill passes layer by layer, so a request
waits only for `cost.exposed_transfer_seconds` after its prefill ends. Only the prompt pages
the decoder's prefix cache lacks move (none: no transfer, and a prompt the decoder holds whole
is not prefilled at all); drafting with MTP, the module's layer moves too (one more layer of
the same size). Transfers do not contend with each other for NICs (a simplification: one
request's push uses the links far below their capacity at the rates the planner considers).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from orchestrator.sim.cost import CostModel, StepShape, exposed_transfer_seconds
from orchestrator.sim.delivery import delivered_gaps
from orchestrator.sim.instances import (
    DecodeInstance,
    EngineLimits,
    PrefillInstance,
    SimRequest,
)
from orchestrator.sim.mixed import MixedInstance
from orchestrator.sim.noise import StepNoise
from orchestrator.sim.options import ServingOptions
from orchestrator.sim.shared_cores import ProcessorSharing, StepEnd
from orchestrator.sim.workload import Arrivals, RequestSpec

# An instance of any role: what the simulator steps.
Instance = PrefillInstance | DecodeInstance | MixedInstance


@dataclass(frozen=True)
class Layout:
    """Instance counts and TP sizes: prefill + decode groups, or mixed alone.

    ep_decode: decode instances per expert-parallel domain (`CostModel.spread_experts`): 1,
    each instance holds every expert (how pdserve's engine runs); k > 1, every k decode
    instances spread one copy of the routed experts over their GPUs (a what-if for wide
    expert parallelism: the planner tries it only when asked, and never emits it, as the
    engine does not run it).
    """

    num_prefill: int = 0
    num_decode: int = 0
    num_mixed: int = 0
    tp_prefill: int = 1
    tp_decode: int = 1
    tp_mixed: int = 1
    ep_decode: int = 1

    def __post_init__(self) -> None:
        counts = (self.num_prefill, self.num_decode, self.num_mixed)
        if min(counts) < 0 or min(self.tp_prefill, self.tp_decode, self.tp_mixed) < 1:
            raise ValueError(f"counts must be >= 0 and TP sizes >= 1: {self}")
        disaggregated = self.num_prefill > 0 and self.num_decode > 0 and self.num_mixed == 0
        mixed = self.num_mixed > 0 and self.num_prefill == self.num_decode == 0
        if not (disaggregated or mixed):
            raise ValueError(f"give prefill and decode instances, or mixed alone: {self}")
        if self.ep_decode < 1 or (
            self.ep_decode > 1 and (not disaggregated or self.num_decode % self.ep_decode)
        ):
            raise ValueError(
                f"an expert-parallel domain of {self.ep_decode} decode instances must divide "
                f"the decode group (mixed instances in one are not modelled): {self}"
            )

    @property
    def is_mixed(self) -> bool:
        return self.num_mixed > 0

    @property
    def num_gpus(self) -> int:
        return (
            self.num_prefill * self.tp_prefill
            + self.num_decode * self.tp_decode
            + self.num_mixed * self.tp_mixed
        )

    @property
    def label(self) -> str:
        if self.is_mixed:
            return f"{self.num_mixed}M(tp{self.tp_mixed})"
        decode = f"tp{self.tp_decode}"
        if self.ep_decode > 1:
            decode += f",ep{self.ep_decode * self.tp_decode}"
        return f"{self.num_prefill}P(tp{self.tp_prefill}):{self.num_decode}D({decode})"


@dataclass(frozen=True)
class RequestRecord:
    """One finished request; times in seconds from the first arrival."""

    request_id: int
    arrival_time: float
    prefill_start_time: float
    kv_ready_time: float
    first_token_time: float
    finish_time: float
    num_prompt_tokens: int
    num_output_tokens: int
    max_itl: float = 0.0  # the longest gap between two of its tokens (a stall)
    # Every gap between two of its tokens, in order (its instance's step times; a step that
    # emits several tokens gives one gap and zeros, as the load generator counts them):
    # ITL percentiles pool these over the measured requests only.
    itl_gaps: np.ndarray = field(default_factory=lambda: np.zeros(0), compare=False, repr=False)
    num_cached_tokens: int = 0  # prompt tokens its prefill (or mixed) instance had cached
    num_transferred_tokens: int = 0  # prompt tokens whose KV was pushed to its decoder
    transferred_bytes: int = 0  # the bytes of that push

    @property
    def ttft(self) -> float:
        return self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float:
        return self.finish_time - self.arrival_time

    @property
    def queue_time(self) -> float:
        return self.prefill_start_time - self.arrival_time

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (0 for one-token answers)."""
        if self.num_output_tokens < 2:
            return 0.0
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass(frozen=True)
class SimResult:
    layout: Layout
    records: tuple[RequestRecord, ...]
    # Per decode (or mixed) step: (duration, sequences for which it is an inter-token gap),
    # warm-up and drain included (`metrics.summarize` takes ITL from the records' gaps).
    itl_steps: tuple[tuple[float, int], ...] = field(repr=False)
    busy_seconds: tuple[float, ...] = field(repr=False)

    @property
    def makespan(self) -> float:
        return max(r.finish_time for r in self.records) - min(r.arrival_time for r in self.records)


class UnservableError(ValueError):
    """A request that no instance of the layout can ever hold (KV capacity)."""


class UnsupportedLayoutError(ValueError):
    """A layout with a TP size the cost model does not run (`CostModel.supports_tp`: the
    weights do not fit, or the heads do not shard): its instances would hold no KV."""


class Simulator:
    """One run (``run`` once per instance). ``limits`` are the decode (or mixed) instances';
    ``prefill_limits`` the prefill instances' (default: the same). ``seed``: of the step-time
    noise of a cost model that has a spread (`noise`); the same seed, the same run.
    ``options``: speculative decoding, prefix caching and routing (default: no drafts,
    caching on, least-outstanding routing)."""

    def __init__(
        self,
        cost: CostModel,
        layout: Layout,
        limits: EngineLimits | None = None,
        prefill_limits: EngineLimits | None = None,
        seed: int = 0,
        options: ServingOptions | None = None,
    ) -> None:
        sizes = (layout.tp_mixed,) if layout.is_mixed else (layout.tp_prefill, layout.tp_decode)
        # Decoders of an expert-parallel domain hold only their share of the experts: a TP
        # size too small for the whole model may hold theirs.
        decode_cost = cost.spread_experts(layout.ep_decode) if layout.ep_decode > 1 else cost
        holders = (cost,) if layout.is_mixed else (cost, decode_cost)
        pairs = zip(holders, sizes, strict=True)
        unsupported = sorted({tp for model, tp in pairs if not model.supports_tp(tp)})
        if unsupported:
            raise UnsupportedLayoutError(
                f"{layout.label}: {cost.name} does not run at TP "
                f"{', '.join(map(str, unsupported))} (the weights do not fit, or the heads do "
                "not shard that way)"
            )
        self.cost, self.layout = cost, layout
        self.limits = limits or EngineLimits()
        self.prefill_limits = prefill_limits or self.limits
        self.options = options = options or ServingOptions()
        if options.mtp:
            # A model without an MTP module cannot draft with it: refused here (ValueError),
            # not in the middle of the run.
            cost.step_seconds(StepShape(1, 1, 1, 1, 1, 1, 1, 1), sizes[-1])
        self._events: list[tuple[float, int, Callable[[float], None]]] = []
        self._order = itertools.count()
        self._finished: list[SimRequest] = []
        self._next_turn: dict[int, RequestSpec] = {}  # request id -> its conversation's next
        self._overhead = 0.0
        self.prefills: list[PrefillInstance] = []
        self.decodes: list[DecodeInstance | MixedInstance] = []
        if layout.is_mixed:
            self.decodes = [
                MixedInstance(cost, layout.tp_mixed, self.limits, options)
                for _ in range(layout.num_mixed)
            ]
        else:
            self.prefills = [
                PrefillInstance(cost, layout.tp_prefill, self.prefill_limits, options)
                for _ in range(layout.num_prefill)
            ]
            self.decodes = [
                DecodeInstance(decode_cost, layout.tp_decode, self.limits, options)
                for _ in range(layout.num_decode)
            ]
        # The cost model's spread of step times, if it has one, drawn from ``seed``.
        noise = StepNoise(cost.step_noise(), seed)
        for instance in [*self.prefills, *self.decodes]:
            instance.noise = noise
        self._seed = seed
        shared = cost.shared_cores
        self._sharing: ProcessorSharing[Instance] | None = (
            ProcessorSharing(shared) if shared is not None else None
        )

    def run(self, workload: Arrivals | list[RequestSpec]) -> SimResult:
        specs = workload if isinstance(workload, list) else workload.requests()
        capacity = self.decodes[0].capacity
        # A prefill instance holds the prompt's KV (all but the last token) until it is pushed.
        prefill_capacity = self.prefills[0].capacity if self.prefills else capacity
        overhead = self.cost.request_overhead_seconds(not self.layout.is_mixed)
        if overhead < 0:
            raise ValueError(f"{self.cost.name}: negative request overhead {overhead}")
        self._overhead = overhead
        seen: set[int] = set()
        for spec in specs:
            if spec.follows >= 0:
                if spec.follows not in seen or spec.follows in self._next_turn:
                    raise ValueError(
                        f"request {spec.request_id} follows {spec.follows}, which is not an "
                        "earlier request without another follower"
                    )
                self._next_turn[spec.follows] = spec
            seen.add(spec.request_id)
            needed = spec.num_prompt_tokens + spec.num_output_tokens
            if needed > capacity:
                raise UnservableError(
                    f"request {spec.request_id} needs {needed} KV tokens; a "
                    f"{self.layout.label} instance holds {capacity}"
                )
            if spec.num_prompt_tokens - 1 > prefill_capacity:
                raise UnservableError(
                    f"request {spec.request_id}'s prompt needs {spec.num_prompt_tokens - 1} KV "
                    f"tokens; a prefill instance of {self.layout.label} holds {prefill_capacity}"
                )
            if spec.follows < 0:
                self._push(spec.arrival_time + overhead, self._on_arrival_of(SimRequest(spec)))
        while self._events:
            time, _, handler = heapq.heappop(self._events)
            handler(time)
        return self._result(len(specs))

    # --- events ---------------------------------------------------------------------------

    def _push(self, time: float, handler: Callable[[float], None]) -> None:
        heapq.heappush(self._events, (time, next(self._order), handler))

    def _on_arrival_of(self, request: SimRequest) -> Callable[[float], None]:
        return lambda now: self._arrive(request, now)

    def _arrive(self, request: SimRequest, now: float) -> None:
        index = self._pick_decoder(request)
        decode = self.decodes[index]
        decode.num_outstanding += 1
        request.decode_index = index
        if isinstance(decode, MixedInstance):
            decode.waiting.append(request)
            self._kick(decode, now)
            return
        # The decoder shares the pages of the prompt's cached prefix before it asks for the
        # rest (docs/design.md §4): those are neither pushed nor evicted.
        prompt_kv = request.spec.num_prompt_tokens - 1
        request.num_decoder_cached_tokens = decode.cache.hit(request.spec, prompt_kv)
        decode.cache.take(request.spec)
        if request.num_decoder_cached_tokens == prompt_kv:
            # Nothing to prefill or push (a one-token prompt, or one held whole): the
            # decoder runs it.
            request.prefill_start_time = request.prefill_end_time = now
            self._kv_ready(request, now)
        else:
            prefill = self._pick_prefill(request)
            prefill.add(request)
            self._kick(prefill, now)

    def _pick_decoder(self, request: SimRequest) -> int:
        """The decode (or mixed) instance the router sends ``request`` to."""
        indices = range(len(self.decodes))
        if self.options.routing != "kv_aware":
            return min(indices, key=lambda i: self.decodes[i].num_outstanding)
        options, prompt = self.options, request.spec.num_prompt_tokens
        capacity = self.limits.max_num_seqs

        def score(i: int) -> tuple[float, int]:
            decode = self.decodes[i]
            if isinstance(decode, MixedInstance):
                held = decode.cached_tokens(request)
            else:
                held = decode.cache.hit(request.spec, prompt - 1)
            load = decode.num_outstanding
            value = (
                options.kv_cache_weight * held / prompt - options.kv_load_weight * load / capacity
            )
            return round(value, 9), -load

        return max(indices, key=score)  # ties: the least loaded, then the first

    def _pick_prefill(self, request: SimRequest) -> PrefillInstance:
        if self.options.routing != "kv_aware":
            return min(self.prefills, key=lambda p: p.num_queued_tokens)
        prompt_kv = request.spec.num_prompt_tokens - 1
        return min(
            self.prefills,
            key=lambda p: p.num_queued_tokens + prompt_kv - p.cached_tokens(request),
        )

    def _kick(self, instance: Instance, now: float) -> None:
        if instance.is_busy:
            return
        due = instance.paced_until(now)
        if due is not None:  # a decode-only step paced (`EngineLimits.min_step_interval_s`)
            if instance.pace_wake_at != due:
                instance.pace_wake_at = due
                self._push(due, functools.partial(self._kick, instance))
            return
        if self._sharing is not None:
            price = instance.start_step(now)  # priced alone (busy_other_roles stays empty)
            if price is not None:
                instance.last_step_start = now
                self._schedule(self._sharing.start(instance, instance.role, price, now))
            return
        instance.busy_other_roles = tuple(
            other.role
            for other in [*self.prefills, *self.decodes]
            if other.is_busy and other is not instance
        )
        duration = instance.start_step(now)
        if duration is not None:
            instance.last_step_start = now
            self._push(now + duration, lambda end: self._step_done(instance, end, duration))

    def _schedule(self, ends: list[StepEnd[Instance]]) -> None:
        for instance, version, time in ends:
            self._push(time, functools.partial(self._shared_step_end, instance, version))

    def _shared_step_end(self, instance: Instance, version: int, now: float) -> None:
        assert self._sharing is not None
        ended = self._sharing.end(instance, version, now)
        if ended is None:
            return  # the cores were re-divided after this end time was set
        seconds, ends = ended
        self._schedule(ends)
        self._step_done(instance, now, seconds)

    def _step_done(
        self,
        instance: Instance,
        now: float,
        duration: float,
    ) -> None:
        done = instance.finish_step(now, duration)
        if isinstance(instance, PrefillInstance):
            for request in done:
                missing = request.spec.num_prompt_tokens - 1 - request.num_decoder_cached_tokens
                request.num_transferred_tokens = missing
                total = self.cost.transfer_seconds(
                    self._pushed_tokens(missing), self.layout.tp_prefill, self.layout.tp_decode
                )
                exposed = exposed_transfer_seconds(
                    total, request.prefill_seconds, self.cost.num_layers
                )
                self._push(now + exposed, functools.partial(self._kv_ready, request))
        else:
            for request in done:
                instance.num_outstanding -= 1
                self._finished.append(request)
                self._send_next_turn(request, now)
        self._kick(instance, now)

    def _pushed_tokens(self, num_tokens: int) -> int:
        """Tokens whose KV bytes a push of ``num_tokens`` prompt tokens moves: drafting with
        MTP, the module's layer goes too, one more layer like the others."""
        if not self.options.mtp:
            return num_tokens
        layers = self.cost.num_layers
        return math.ceil(num_tokens * (layers + 1) / layers)

    def _send_next_turn(self, request: SimRequest, now: float) -> None:
        spec = self._next_turn.pop(request.spec.request_id, None)
        if spec is None:
            return
        following = SimRequest(spec)
        following.arrival_time = now + spec.think_time_s
        self._push(following.arrival_time + self._overhead, self._on_arrival_of(following))

    def _kv_ready(self, request: SimRequest, now: float) -> None:  # an event handler
        request.kv_ready_time = now
        decode = self.decodes[request.decode_index]
        assert isinstance(decode, DecodeInstance)
        decode.waiting.append(request)
        self._kick(decode, now)

    # --- result ---------------------------------------------------------------------------

    def _result(self, num_arrivals: int) -> SimResult:
        if len(self._finished) != num_arrivals:
            # Conservation: every arrival leaves; anything else is a simulator bug.
            raise RuntimeError(f"{num_arrivals} arrivals, {len(self._finished)} finished")
        durations = [np.array([d for d, _ in instance.itl_steps]) for instance in self.decodes]
        # The tokens' way out (`delivery`), drawn in request order from a generator of its own:
        # the same seed, the same gaps, whatever the step noise drew.
        delay = self.cost.token_delay_seconds(not self.layout.is_mixed)
        ways_out = np.random.default_rng([self._seed, 1])
        records = tuple(
            self._record(r, durations, delay, ways_out)
            for r in sorted(self._finished, key=lambda r: r.spec.request_id)
        )
        itl = tuple(step for d in self.decodes for step in d.itl_steps)
        busy = tuple(i.busy_seconds for i in [*self.prefills, *self.decodes])
        return SimResult(self.layout, records, itl, busy)

    def _record(
        self,
        request: SimRequest,
        durations: list[np.ndarray],
        token_delay: float,
        ways_out: np.random.Generator,
    ) -> RequestRecord:
        times = (
            request.prefill_start_time,
            request.kv_ready_time,
            request.first_token_time,
            request.finish_time,
        )
        if any(t is None for t in times):
            raise RuntimeError(f"request {request.spec.request_id} finished without {times}")
        start, ready, first, finish = (float(t) for t in times)  # type: ignore[arg-type]
        spec = request.spec
        # Its instance steps back to back while it runs (or paced): each later step's gap is
        # the time since the step before it ended (`InstanceBase._gap`).
        steps = durations[request.decode_index][
            request.first_token_step + 1 : request.last_step + 1
        ]
        gaps = steps if request.emitted is None else _gaps_with_zeros(steps, request.emitted)
        gaps = delivered_gaps(gaps, token_delay, ways_out)
        moved = request.num_transferred_tokens
        return RequestRecord(
            spec.request_id,
            request.arrival_time,
            start,
            ready,
            first,
            finish,
            spec.num_prompt_tokens,
            spec.num_output_tokens,
            float(gaps.max()) if len(gaps) else 0.0,
            gaps,
            request.num_cached_tokens,
            moved,
            self.cost.kv_bytes(self._pushed_tokens(moved)) if moved else 0,
        )


def _gaps_with_zeros(steps: np.ndarray, emitted: list[int]) -> np.ndarray:
    """Gaps before each token after the first: a step's duration before the first token it
    emits, 0 before the others (``emitted``: tokens per step, from the first token's step)."""
    counts = np.asarray(emitted, dtype=np.int64)
    if len(counts) != len(steps) + 1:
        raise RuntimeError(f"{len(counts)} steps emitted tokens, {len(steps) + 1} expected")
    gaps = np.zeros(int(counts.sum()) - 1)
    starts = np.cumsum(counts) - counts  # index of each step's first token
    gaps[starts[1:] - 1] = steps
    return gaps


def simulate(
    cost: CostModel,
    layout: Layout,
    workload: Arrivals,
    limits: EngineLimits | None = None,
    options: ServingOptions | None = None,
    prefill_limits: EngineLimits | None = None,
) -> SimResult:
    """One run; ``prefill_limits``: the prefill instances' (default: ``limits``)."""
    return Simulator(cost, layout, limits, prefill_limits, options=options).run(workload)


__all__ = [
    "EngineLimits",
    "Layout",
    "RequestRecord",
    "SimResult",
    "Simulator",
    "UnservableError",
    "UnsupportedLayoutError",
    "simulate",
]
