"""Life cycle of one KV transfer on each side, keyed by the request id.

Decoder side (`DecodeTransfer`)::

    ALLOCATED ──(counter armed, PrefillRequest sent)──▶ REQUESTED ──(first write)──▶ RECEIVING
        │                                                 │  └──────(count reached)──────┐  │
        │                                                 │                              ▼  ▼
        └──────────────▶ FAILED ◀──(deadline, rejected, abort, protocol error)──┘      READY

- ALLOCATED: non-evictable pages and an imm slot reserved.
- REQUESTED: counter armed with the expected write count; the request is blocked from decode.
- RECEIVING: optional, the first write was counted (lets metrics see transfer start).
- READY: count reached; slot released, transfer context freed, request handed to the engine.
- FAILED: the slot is released as not drained and the pages go to quarantine
  (`workers.kv.quarantine`) because writes may still be in flight.

Prefill side (`PrefillTransfer`)::

    QUEUED ──▶ PREFILLING ──(last chunk's forward done)──▶ WRITING ──(all completions)──▶ DONE
       │            │                                         │
       │            └────────────(abort / error)──────────────┴──▶ DRAINING ──▶ CANCELLED | FAILED
       └──(abort / error, nothing submitted)──▶ CANCELLED | FAILED

- PREFILLING: chunks scheduled; layer writes are already submitted as layers finish.
- WRITING: the forward passes are over; writes (and the context write) in flight.
- DRAINING: no further writes are submitted; waiting for in-flight ones before the source pages
  are freed, since the NIC still reads them.
- Writes are counted as submitted before they are posted (an abort acknowledgement never
  undercounts); those the fabric then refuses at once are taken back (`unrecord_submit`), so
  ``num_writes_submitted`` is what was posted (or is about to be) and never more.
- A terminal state is entered only with no write in flight: pages are freed right after.

Times are ``time.monotonic()`` seconds of the local host, passed in (pure, testable). Times of
the two hosts are never subtracted from each other except in single-host deployments and tests.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from workers.kv.errors import IllegalTransitionError

S = TypeVar("S", bound=enum.Enum)


class DecodeState(enum.Enum):
    ALLOCATED = "allocated"
    REQUESTED = "requested"
    RECEIVING = "receiving"
    READY = "ready"
    FAILED = "failed"


# A decode transfer whose PrefillRequest went and whose writes are not all in yet.
WAITING_FOR_WRITES = (DecodeState.REQUESTED, DecodeState.RECEIVING)


class PrefillState(enum.Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    WRITING = "writing"
    DRAINING = "draining"
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"


_D = DecodeState
DECODE_TRANSITIONS: Mapping[DecodeState, frozenset[DecodeState]] = {
    _D.ALLOCATED: frozenset({_D.REQUESTED, _D.FAILED}),
    _D.REQUESTED: frozenset({_D.RECEIVING, _D.READY, _D.FAILED}),
    _D.RECEIVING: frozenset({_D.READY, _D.FAILED}),
    _D.READY: frozenset(),
    _D.FAILED: frozenset(),
}

_P = PrefillState
_STOPPED = frozenset({_P.DRAINING, _P.CANCELLED, _P.FAILED})
PREFILL_TRANSITIONS: Mapping[PrefillState, frozenset[PrefillState]] = {
    _P.QUEUED: frozenset({_P.PREFILLING, _P.CANCELLED, _P.FAILED}),
    _P.PREFILLING: frozenset({_P.WRITING}) | _STOPPED,
    _P.WRITING: frozenset({_P.DONE}) | _STOPPED,
    _P.DRAINING: frozenset({_P.CANCELLED, _P.FAILED}),
    _P.DONE: frozenset(),
    _P.CANCELLED: frozenset(),
    _P.FAILED: frozenset(),
}


@dataclass
class TransferStats:
    """Measurements of one transfer (local monotonic seconds; None until observed)."""

    num_bytes: int = 0
    num_writes: int = 0
    first_submit_s: float | None = None
    last_submit_s: float | None = None
    first_completion_s: float | None = None
    last_completion_s: float | None = None
    forward_end_s: float | None = None  # prefill: end of the request's last forward pass
    kv_ready_s: float | None = None  # decoder: expected count reached

    def record_submit(self, now_s: float, num_bytes: int, count: int = 1) -> None:
        if self.first_submit_s is None:
            self.first_submit_s = now_s
        self.last_submit_s = now_s
        self.num_bytes += num_bytes
        self.num_writes += count

    def unrecord_submit(self, num_bytes: int, count: int) -> None:
        """Take back a `record_submit` whose writes were never posted (the submit times stay:
        they bound when something was last tried)."""
        self.num_bytes -= num_bytes
        self.num_writes -= count

    def record_completion(self, now_s: float) -> None:
        if self.first_completion_s is None:
            self.first_completion_s = now_s
        self.last_completion_s = now_s

    @property
    def exposed_transfer_s(self) -> float | None:
        """Transfer time not hidden behind the forward pass: KV ready - forward end.

        Needs both times on one clock (colocated tests); on a prefill host alone the estimate is
        `exposed_transfer_estimate_s`.
        """
        if self.kv_ready_s is None or self.forward_end_s is None:
            return None
        return self.kv_ready_s - self.forward_end_s

    @property
    def exposed_transfer_estimate_s(self) -> float | None:
        """Prefill-side estimate: last initiator completion - forward end."""
        if self.last_completion_s is None or self.forward_end_s is None:
            return None
        return self.last_completion_s - self.forward_end_s


class _StateMachine(Generic[S]):
    TRANSITIONS: ClassVar[Mapping[Any, frozenset[Any]]]

    def __init__(self, request_id: str, initial: S, now_s: float) -> None:
        if not request_id:
            raise ValueError("request_id must be non-empty")
        self.request_id = request_id
        self.state: S = initial
        self.history: list[tuple[S, float]] = [(initial, now_s)]
        self.failure_reason: str | None = None
        self.stats = TransferStats()

    @property
    def is_terminal(self) -> bool:
        return not self.TRANSITIONS[self.state]

    def advance(self, to: S, now_s: float) -> None:
        if to not in self.TRANSITIONS[self.state]:
            raise IllegalTransitionError(
                f"{type(self).__name__} {self.request_id}: {self.state.name} -> {to.name}"
            )
        self._check_enter(to)
        self.state = to
        self.history.append((to, now_s))

    def entered_at(self, state: S) -> float | None:
        return next((t for s, t in self.history if s is state), None)

    def _check_enter(self, to: S) -> None:
        """Extra preconditions of entering ``to`` (override)."""


class DecodeTransfer(_StateMachine[DecodeState]):
    TRANSITIONS = DECODE_TRANSITIONS

    def __init__(
        self,
        request_id: str,
        imm: int,
        page_ids: tuple[int, ...],
        num_writes_expected: int | None,
        deadline_s: float,
        now_s: float,
    ) -> None:
        """``num_writes_expected`` None: not known yet (coalesced runs depend on the prefill's
        page ids); `set_expected` supplies it from `PrefillAccepted`."""
        super().__init__(request_id, DecodeState.ALLOCATED, now_s)
        self.imm = imm
        self.page_ids = page_ids
        self.num_writes_expected: int | None = None
        if num_writes_expected is not None:
            self.set_expected(num_writes_expected)
        self.num_writes_seen = 0
        self.deadline_s = deadline_s

    def set_expected(self, num_writes_expected: int) -> None:
        """Fix the expected count (once); a different second value means the sides disagree."""
        if num_writes_expected < 1:
            raise ValueError(f"num_writes_expected must be >= 1, got {num_writes_expected}")
        if self.num_writes_expected not in (None, num_writes_expected):
            raise IllegalTransitionError(
                f"{self.request_id}: expected {self.num_writes_expected} writes, "
                f"told {num_writes_expected}"
            )
        self.num_writes_expected = num_writes_expected

    def _expected(self) -> int:
        if self.num_writes_expected is None:
            raise IllegalTransitionError(f"{self.request_id}: expected write count not known")
        return self.num_writes_expected

    def record_writes(self, count: int, now_s: float) -> bool:
        """Count arrived writes; advances to RECEIVING / READY; True once READY."""
        if self.state not in WAITING_FOR_WRITES:
            raise IllegalTransitionError(f"{self.request_id}: writes counted in {self.state.name}")
        expected = self._expected()
        self.num_writes_seen += count
        self.stats.num_writes += count
        self.stats.record_completion(now_s)
        if self.num_writes_seen > expected:
            # More writes than planned means the two sides disagree on the plan: the KV is
            # suspect and must not be decoded from.
            self.fail(f"received {self.num_writes_seen} writes, expected {expected}", now_s)
            return False
        if self.num_writes_seen == expected:
            self.stats.kv_ready_s = now_s
            self.advance(DecodeState.READY, now_s)
            return True
        if self.state is DecodeState.REQUESTED:
            self.advance(DecodeState.RECEIVING, now_s)
        return False

    def count_reached(self, now_s: float) -> None:
        """The fabric's imm counter fired: it counted every expected write (it is the source of
        truth when the messenger does not see individual arrivals)."""
        if self.state not in WAITING_FOR_WRITES:
            raise IllegalTransitionError(f"{self.request_id}: count reached in {self.state.name}")
        expected = self._expected()
        self.stats.num_writes += expected - self.num_writes_seen
        self.num_writes_seen = expected
        self.stats.record_completion(now_s)
        self.stats.kv_ready_s = now_s
        self.advance(DecodeState.READY, now_s)

    def fail(self, reason: str, now_s: float) -> None:
        self.failure_reason = reason
        self.advance(DecodeState.FAILED, now_s)

    def is_expired(self, now_s: float) -> bool:
        return not self.is_terminal and now_s >= self.deadline_s

    def _check_enter(self, to: DecodeState) -> None:
        if to is DecodeState.READY and self.num_writes_seen != self.num_writes_expected:
            raise IllegalTransitionError(
                f"{self.request_id}: READY with {self.num_writes_seen} of "
                f"{self.num_writes_expected} writes"
            )


class PrefillTransfer(_StateMachine[PrefillState]):
    TRANSITIONS = PREFILL_TRANSITIONS

    def __init__(
        self, request_id: str, imm: int, num_writes_planned: int | None, now_s: float
    ) -> None:
        """``num_writes_planned`` None: known once every source page is allocated
        (`set_planned`); until then submits are not bounded by it."""
        super().__init__(request_id, PrefillState.QUEUED, now_s)
        self.imm = imm
        self.num_writes_planned: int | None = None
        if num_writes_planned is not None:
            self.set_planned(num_writes_planned)
        self.num_writes_completed = 0
        self.num_writes_failed = 0
        self._stopped_as: PrefillState | None = None  # CANCELLED or FAILED once stopped

    def set_planned(self, num_writes_planned: int) -> None:
        if num_writes_planned < 1:
            raise ValueError(f"num_writes_planned must be >= 1, got {num_writes_planned}")
        if num_writes_planned < self.num_writes_submitted:
            raise IllegalTransitionError(
                f"{self.request_id}: planned {num_writes_planned} < already submitted "
                f"{self.num_writes_submitted}"
            )
        self.num_writes_planned = num_writes_planned

    @property
    def num_writes_submitted(self) -> int:
        return self.stats.num_writes

    @property
    def num_writes_in_flight(self) -> int:
        return self.num_writes_submitted - self.num_writes_completed - self.num_writes_failed

    @property
    def accepts_writes(self) -> bool:
        return self.state in (PrefillState.PREFILLING, PrefillState.WRITING)

    def record_submit(self, num_bytes: int, now_s: float, count: int = 1) -> None:
        if not self.accepts_writes:
            raise IllegalTransitionError(f"{self.request_id}: write submitted in {self.state.name}")
        planned = self.num_writes_planned
        if planned is not None and self.num_writes_submitted + count > planned:
            raise IllegalTransitionError(f"{self.request_id}: more writes than planned")
        self.stats.record_submit(now_s, num_bytes, count)

    def unrecord_submit(self, num_bytes: int, count: int = 1) -> None:
        """Take back ``count`` writes recorded by `record_submit` that the fabric refused at
        once (nothing of them left, so none can land): every count reported to the decoder
        after this (`PrefillFailed`, `AbortAcknowledged`) excludes them, or the decoder would
        wait forever for writes that never come. The state is left to the caller (it stops
        the transfer: the planned count can no longer be reached); DRAINING may end once
        nothing else is in flight (`finish_if_drained`)."""
        if count < 1 or self.num_writes_in_flight < count:
            raise IllegalTransitionError(
                f"{self.request_id}: {count} writes taken back, {self.num_writes_in_flight} "
                "in flight"
            )
        self.stats.unrecord_submit(num_bytes, count)

    def record_completion(self, now_s: float, *, ok: bool = True, count: int = 1) -> None:
        if self.num_writes_in_flight < count:
            raise IllegalTransitionError(f"{self.request_id}: completion without a write")
        if ok:
            self.num_writes_completed += count
            self.stats.record_completion(now_s)
            return
        self.num_writes_failed += count
        # A lost write means the decoder can never reach its count: fail the transfer now.
        if self.accepts_writes:
            self.stop("write failed", now_s, failed=True)

    def stop(self, reason: str, now_s: float, *, failed: bool) -> None:
        """Abort (``failed=False``) or fail: no more submits; terminal once drained."""
        self.failure_reason = reason
        outcome = PrefillState.FAILED if failed else PrefillState.CANCELLED
        self._stopped_as = outcome
        self.advance(PrefillState.DRAINING if self.num_writes_in_flight else outcome, now_s)

    def finish_if_drained(self, now_s: float) -> bool:
        """From WRITING or DRAINING, enter the terminal state once nothing is in flight; True
        when the transfer is terminal now (also if it already was: `stop` or a failed last
        write in flight ends it at once, with nothing left to drain)."""
        if self.is_terminal:
            return True
        if self.num_writes_in_flight:
            return False
        if self.state is PrefillState.WRITING:
            if self.num_writes_completed == self.num_writes_planned:
                self.advance(PrefillState.DONE, now_s)
                return True
            return False
        if self.state is PrefillState.DRAINING:
            assert self._stopped_as is not None  # DRAINING is only entered through stop()
            self.advance(self._stopped_as, now_s)
            return True
        return False

    def _check_enter(self, to: PrefillState) -> None:
        if to is PrefillState.DRAINING and self._stopped_as is None:
            raise IllegalTransitionError(f"{self.request_id}: enter DRAINING through stop()")
        terminal = not PREFILL_TRANSITIONS[to]
        if terminal and self.num_writes_in_flight:
            raise IllegalTransitionError(
                f"{self.request_id}: {to.name} with {self.num_writes_in_flight} writes in flight"
            )
        if to is PrefillState.DONE and self.num_writes_completed != self.num_writes_planned:
            raise IllegalTransitionError(
                f"{self.request_id}: DONE after {self.num_writes_completed} of "
                f"{self.num_writes_planned} writes"
            )


T = TypeVar("T", bound="_StateMachine[Any]")


@dataclass
class TransferTable(Generic[T]):
    """The messenger's transfers by request id (one id, one transfer, either side)."""

    _by_id: dict[str, T] = field(default_factory=dict)

    def add(self, transfer: T) -> None:
        if transfer.request_id in self._by_id:
            raise KeyError(f"transfer {transfer.request_id} already exists")
        self._by_id[transfer.request_id] = transfer

    def get(self, request_id: str) -> T | None:
        return self._by_id.get(request_id)

    def pop(self, request_id: str) -> T:
        return self._by_id.pop(request_id)

    def in_state(self, *states: enum.Enum) -> list[T]:
        return [t for t in self._by_id.values() if t.state in states]

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def __iter__(self) -> Iterator[T]:
        return iter(self._by_id.values())
