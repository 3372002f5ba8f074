"""Decode side of the KV messenger: reserve pages, ask a prefill worker to fill them, admit.

Queues and life cycle (keyed by request id)::

    start() ──▶ pending (no pages / slot yet) ──▶ ALLOCATED (pinned pages, imm slot, context row)
      ──PrefillRequest──▶ REQUESTED ──PrefillAccepted(count): arm counter──▶ counter fires
      ──▶ READY: slot released, engine.add_prefilled_request (the last prompt token runs first)
    deadline / PrefillRejected / PrefillFailed / abort ──▶ FAILED: counter cancelled, pages +
      slot ──▶ quarantine (AbortPrefill re-sent every drain interval)
      ──(all writes landed | acknowledged count landed | prefill process gone)──▶ free

- A one-token prompt has no KV to prefill: it goes to the engine at once.
- A pending request waits at most ``admission_timeout_s`` (default: the transfer deadline) for
  its pages and slot, then fails (`AdmissionTimeoutError`'s message); it holds nothing yet, so
  nothing is freed.
- A prefill worker that fails a transfer it accepted sends `PrefillFailed` (reason and the
  number of writes it submitted): the request fails at once and its pages are quarantined as
  on an abort, released when that many writes landed (or the prefill process is gone).
- A prefill process that dies sends nothing: every ``liveness_interval_s`` the prefill worker
  of each address whose live transfers had no write land since the last look is checked
  (`_check_liveness`, the same evidence as the quarantine's below); gone, its transfers fail
  at once and their pages are freed (`_gone`), long before their deadline.
- **Quarantine** (`workers.kv.quarantine`): time never frees pages, since a paused prefill
  process can post a write long after any deadline. Every ``drain_interval_s`` the decoder
  re-sends `AbortPrefill` for each quarantined transfer; the prefill worker answers with its
  submitted count (`AbortAcknowledged`), also for a transfer it ended or never saw (0). Its
  process counts as gone (pages freed) when the fabric reports its connection failed or its
  process exited (`TransferEngine.peer_failure`; a missed deadline is no proof), when an abort
  stays uncompleted for an interval (or misses its deadline) and nothing listens at its ``tcp``
  address any more (`workers.kv.peer_liveness`; a stopped process's kernel still accepts). A
  worker restarted at the same address answers the re-sent aborts with 0 (it never saw them);
  an endpoint naming another incarnation frees nothing (it may be stale, see `_peer`). A
  paused prefill process keeps its pages quarantined (capacity, never corruption) until it
  answers or is replaced.
- The request stays out of decode scheduling (its pages are pinned, the engine does not know
  it) until the counter reached the expected count.
- The expected count is the plan's (`workers.kv.writes`): with coalescing it depends on the
  prefill's page ids and arrives in `PrefillAccepted` (writes landing earlier are buffered by the
  counter); without, the decoder computes it and the prefill side cross-checks it.
- Late writes of a failed transfer cannot count for a newer one: the imm carries generation
  bits, the slot is parked and the pages quarantined until the old writes drained.
- **Checksum mode** (``checksum=True``, `workers.kv.checksum`): the `PrefillRequest` asks for
  it and each context row has room for the sums after the hidden state. When the counter fires
  (so the sums have landed) the decoder recomputes them over the pages it received; a mismatch
  fails the request (`KVChecksumError`'s message, never tokens), frees its pages at once (every
  write landed) and counts in ``num_checksum_failures``.

Threads: `start`, `abort`, `poll` run on the worker's step thread; fabric callbacks only enqueue,
and so does a liveness probe (a short-lived thread: a connect may take up to its timeout).
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from workers.engine.engine_core import EngineCore
from workers.engine.sampling_params import SamplingParams
from workers.fabric import (
    AddressError,
    FabricError,
    Message,
    OperationTimeoutError,
    PeerFailedError,
    PeerHandle,
    TransferEngine,
)
from workers.kv.checksum import area_bytes, byte_view, max_shards, verify
from workers.kv.endpoint import PrefillEndpoint
from workers.kv.errors import (
    AdmissionTimeoutError,
    KVChecksumError,
    KvTransferError,
    ProtocolError,
)
from workers.kv.imm import ImmLayout, SlotTable
from workers.kv.peer_liveness import listener_refuses, tcp_address
from workers.kv.pools import register_engine_pools
from workers.kv.protocol import (
    AbortAcknowledged,
    AbortPrefill,
    PrefillAccepted,
    PrefillFailed,
    PrefillRejected,
    PrefillRequest,
    decode_message,
    encode_message,
)
from workers.kv.quarantine import PageQuarantine, QuarantinedPages
from workers.kv.sharding import GroupSharding, TransferPlan, make_transfer_plan
from workers.kv.transfer_state import WAITING_FOR_WRITES, DecodeState, DecodeTransfer
from workers.kv.writes import expected_write_count_from_dst

log = logging.getLogger(__name__)

_UNKNOWN_COUNT = 1 << 62  # quarantine bound while the prefill side never told its count
# Floor of the AbortPrefill re-send interval (drain_interval_s may be 0: no message storm).
_MIN_RESEND_S = 0.05
# An AbortPrefill not completed after max(interval, this) means the peer takes no messages.
_MIN_STALL_S = 0.5


@dataclass(frozen=True)
class DecodeMessengerConfig:
    transfer_timeout_s: float = 30.0
    # How long a request may wait for decode pages / an imm slot before its PrefillRequest is
    # sent; None: transfer_timeout_s.
    admission_timeout_s: float | None = None
    # How often AbortPrefill is re-sent for a quarantined transfer (and the liveness of its
    # prefill worker checked); never a time after which pages are freed.
    drain_interval_s: float = 5.0
    # How often the prefill workers of live transfers that made no progress since the last look
    # are checked for being gone (`_check_liveness`); 0: only the deadline ends such transfers.
    liveness_interval_s: float = 1.0
    max_transfers: int = 256  # imm slots and rows of the context buffer
    coalesce_pages: bool = True
    finished_memory: int = 4096
    seed: int = 0
    # Checksum mode: verify every transfer's KV against the prefill's sums (costs one read of
    # the received KV on the step thread per request, and CRC-32 on the prefill's push thread).
    checksum: bool = False


@dataclass
class _Incoming:
    prompt: list[int]
    params: SamplingParams
    endpoint: PrefillEndpoint
    admission_deadline_s: float
    transfer: DecodeTransfer | None = None
    peer: PeerHandle | None = None
    armed: bool = False
    checksum_plan: TransferPlan | None = None  # checksum mode: the plan's destination side


@dataclass
class _PeerWatch:
    """The AbortPrefill sends to one prefill address and whether its liveness is probed."""

    name: str
    sent_s: deque[float]  # send times of the aborts not completed yet, oldest first
    probing: bool = False


class DecodeMessenger:
    def __init__(
        self,
        engine: EngineCore,
        fabric: TransferEngine,
        config: DecodeMessengerConfig | None = None,
        *,
        rank_pools: Sequence[object] | None = None,
        sharding: GroupSharding | None = None,
        wake: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self.fabric = fabric
        self.config = config = config or DecodeMessengerConfig()
        model = engine.model_config
        self.sharding, self.geometry, self.pools = register_engine_pools(
            fabric, engine, rank_pools, sharding
        )
        # Context rows of bytes: the hidden state, then (checksum mode only) the checksum area.
        self._hidden_bytes = model.hidden_size * torch.empty((), dtype=engine.dtype).element_size()
        self._row_bytes = self._hidden_bytes
        self._pool_views: list[Any] = []
        if config.checksum:
            self._row_bytes += area_bytes(max_shards(self.sharding))
            self._row_bytes = -(-self._row_bytes // 8) * 8
            self._pool_views = [byte_view(pool) for pool in rank_pools or [engine.kv_cache]]
        self.context = torch.zeros(config.max_transfers, self._row_bytes, dtype=torch.uint8)
        _, self._context_descriptor = fabric.register(self.context)
        self.num_checksum_failures = 0
        self.imm_layout = ImmLayout()
        self.imm_layout.check_provider(fabric.imm_bits // 8)
        self.slots = SlotTable(self.imm_layout, config.max_transfers)
        self.quarantine = PageQuarantine(max(config.drain_interval_s, _MIN_RESEND_S))
        self._stall_s = max(config.drain_interval_s, _MIN_STALL_S)
        self._watches: dict[bytes, _PeerWatch] = {}
        # (address, error or None) of each AbortPrefill send; (address, gone) of each probe.
        self._abort_outcomes: queue.SimpleQueue[tuple[bytes, FabricError | None]] = (
            queue.SimpleQueue()
        )
        self._probe_results: queue.SimpleQueue[tuple[bytes, bool]] = queue.SimpleQueue()
        # Writes landed per live transfer (imm) at the last liveness look, and the next look.
        self._liveness_marks: dict[int, int] = {}
        self._next_liveness_s = 0.0
        self._rng = random.Random(config.seed)
        # This registration's id, sent in each PrefillRequest (a restart draws anew), and the
        # incarnation last confirmed at each prefill address (`_confirm_incarnation`, `_peer`).
        self.incarnation = random.SystemRandom().getrandbits(64) or 1
        self.peer_incarnations: dict[bytes, int] = {}
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        # (imm, when its counter fired): the fire time is the KV-ready time of the measurements.
        self._fired: queue.SimpleQueue[tuple[int, float]] = queue.SimpleQueue()
        self._wake = wake or (lambda: None)
        self._pending: deque[str] = deque()
        self._by_id: dict[str, _Incoming] = {}
        # imm -> writes landed, counted here: the fabric's tombstones are bounded (and a later
        # cancellation may evict one), so each poll takes its new arrivals (`_tend_quarantine`).
        self._quarantined: dict[int, int] = {}
        self._failures: list[tuple[str, str]] = []
        self.finished: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.context_states: OrderedDict[str, torch.Tensor] = OrderedDict()
        fabric.on_message(self._on_message)

    # -- fabric callbacks (enqueue only; _on_reached on the progress thread, see _arm) --------

    def _on_message(self, message: Message) -> None:
        self._inbox.put(message)
        self._wake()

    def _on_reached(self, imm: int) -> None:
        self._fired.put((imm, time.monotonic()))
        self._wake()

    # -- step thread: requests ----------------------------------------------------------------

    def start(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        endpoint: PrefillEndpoint,
    ) -> None:
        """Begin serving a request (validated by the caller); one-token prompts go straight in."""
        if len(prompt) == 1:
            self.engine.add_prefilled_request(request_id, prompt, params, [])
            return
        if request_id in self._by_id:
            raise KvTransferError(f"request {request_id} already has a transfer")
        admission_s = self.config.admission_timeout_s
        if admission_s is None:
            admission_s = self.config.transfer_timeout_s
        self._by_id[request_id] = _Incoming(
            list(prompt), params, endpoint, time.monotonic() + admission_s
        )
        self._pending.append(request_id)
        self._start_pending()

    def _start_pending(self) -> None:
        while self._pending:
            incoming = self._by_id[self._pending[0]]
            num_pages = self.engine.num_prefill_pages(len(incoming.prompt))
            if (
                self.slots.num_live >= self.slots.capacity
                or not self.engine.block_manager.can_allocate(num_pages)
            ):
                return
            request_id = self._pending.popleft()
            try:
                self._request(request_id, incoming, num_pages)
            except (KvTransferError, FabricError) as error:
                self._fail(request_id, f"could not request the KV: {error}")

    def _request(self, request_id: str, incoming: _Incoming, num_pages: int) -> None:
        endpoint = incoming.endpoint
        now = time.monotonic()
        pages = self.engine.allocate_pinned(num_pages)  # can_allocate and num_live were checked
        try:
            imm = self.slots.allocate(request_id)
        except KvTransferError:
            self.engine.free_pinned(pages)
            raise
        slot, _ = self.imm_layout.decode(imm)
        incoming.transfer = DecodeTransfer(
            request_id, imm, tuple(pages), None, now + self.config.transfer_timeout_s, now
        )
        # The imm may be handed out again (its generation wrapped): drop its old tombstone and
        # stray arrivals, or this transfer's writes landing before the counter is armed would be
        # ignored as late ones. Safe: a slot comes back only once no write of its old imm can
        # land (drained when its counter fired, else parked until its pages left quarantine).
        # After `transfer` is set, so that a failure here frees the pages and slot (`_fail`).
        self.fabric.reset_imm(imm)
        incoming.peer = self._peer(endpoint)
        coalesce = self.config.coalesce_pages
        source_sets: tuple[int, ...] = ()
        expected = 0
        src = GroupSharding(endpoint.tp_size, endpoint.num_kv_heads, endpoint.is_mla)
        if not coalesce:
            plan = make_transfer_plan(
                src, self.sharding, self.geometry, rng=self._rng, coalesce_pages=False
            )
            source_sets = plan.source_sets
            expected = expected_write_count_from_dst(plan, pages, self.geometry.num_layers, 1)
            incoming.transfer.set_expected(expected)
            if self.config.checksum:
                incoming.checksum_plan = plan
        elif self.config.checksum:
            # Only the destination side is used; it is the same whichever source replica set
            # the prefill worker picks, so any choice (the first) stands in for its.
            num_picks = 1 if src.is_mla else self.sharding.num_replica_sets
            incoming.checksum_plan = make_transfer_plan(
                src, self.sharding, self.geometry, source_sets=(0,) * num_picks
            )
        max_run = self.fabric.max_pages_per_run(self.pools.layout.page_bytes) or 0
        request = PrefillRequest(
            request_id,
            imm,
            tuple(incoming.prompt[:-1]),
            self.geometry.page_size,
            (tuple(pages),),
            self.sharding.tp_size,
            self.sharding.num_kv_heads,
            self.sharding.is_mla,
            source_sets,
            coalesce,
            endpoint.segment_pages,
            max_run,
            self.pools.descriptor_bytes(),
            self._context_descriptor.to_bytes(),
            slot * self._row_bytes,
            expected,
            max(1, int(self.config.transfer_timeout_s * 1000)),
            self.config.checksum,
            prefill_incarnation=endpoint.incarnation,
            decode_incarnation=self.incarnation,
        )
        if expected:
            self._arm(incoming, expected)
        self.fabric.submit_send(incoming.peer, encode_message(request))
        incoming.transfer.advance(DecodeState.REQUESTED, now)

    def _peer(self, endpoint: PrefillEndpoint) -> PeerHandle:
        """The fabric peer of an endpoint, re-resolved when its incarnation is not the one last
        confirmed at its address: it may be a worker restarted there, to which nothing cached
        of the old process (its failed state) applies.

        Quarantined pages stay held: an endpoint's incarnation is a claim, not proof that the
        old process is gone (a stale registry entry, an unversioned endpoint (0), or a request
        the live worker rejects as stale name another incarnation while it can still write).
        A truly restarted worker answers the re-sent `AbortPrefill` with 0 ("never seen") and
        a dead one shows through its connection or its listener (`_send_aborts`)."""
        known = self.peer_incarnations.get(endpoint.address)
        if known is not None and known != endpoint.incarnation:
            self.fabric.forget_peer(endpoint.address)
        return self.fabric.add_peer(endpoint.address)

    def _confirm_incarnation(self, endpoint: PrefillEndpoint) -> None:
        """The worker at the endpoint's address accepted a request naming its incarnation (a
        worker rejects one naming another): that incarnation serves there now."""
        if endpoint.incarnation:
            self.peer_incarnations[endpoint.address] = endpoint.incarnation

    def _arm(self, incoming: _Incoming, count: int) -> None:
        assert incoming.transfer is not None
        imm = incoming.transfer.imm
        # Inline: it only enqueues and wakes the step thread, so it runs on the fabric's
        # progress thread as the last write lands, without the hop to the callback thread.
        self.fabric.expect_imm(imm, count, partial(self._on_reached, imm), inline=True)
        incoming.armed = True

    def abort(self, request_id: str) -> bool:
        """Abort a request still waiting for its KV; False when it is not (ask the engine)."""
        incoming = self._by_id.get(request_id)
        if incoming is None:
            return False
        self._fail(request_id, "aborted", aborted=True)
        return True

    # -- step thread: progress ----------------------------------------------------------------

    def poll(self) -> list[tuple[str, str]]:
        """Handle messages, fired counters, deadlines and quarantine; returns the requests that
        failed since the last call as ``(request_id, error)`` (aborted ones are not listed)."""
        while True:
            try:
                self._handle_message(self._inbox.get_nowait())
            except queue.Empty:
                break
        while True:
            try:
                self._handle_fired(*self._fired.get_nowait())
            except queue.Empty:
                break
        lost = self.fabric.closed_reason()
        if lost is not None:
            self._fabric_lost(lost)
            return self._take_failures()
        now = time.monotonic()
        self._start_pending()  # pages freed since the last poll count before any deadline
        for request_id, incoming in list(self._by_id.items()):
            transfer = incoming.transfer
            if transfer is None and now >= incoming.admission_deadline_s:
                self._fail(request_id, str(self._admission_timeout(incoming)))
            elif transfer is not None and transfer.is_expired(now):
                seen = self.fabric.imm_arrivals(transfer.imm)
                expected = transfer.num_writes_expected
                self._fail(
                    request_id,
                    f"KV transfer deadline of {self.config.transfer_timeout_s:g} s passed with "
                    f"{seen} of {expected if expected is not None else 'an unknown number of'} "
                    "writes landed (prefill worker dead or overloaded?)",
                )
        interval = self.config.liveness_interval_s
        if interval > 0 and now >= self._next_liveness_s:
            self._next_liveness_s = now + interval
            self._check_liveness()
        self._tend_quarantine(now)
        self._start_pending()
        return self._take_failures()

    def _take_failures(self) -> list[tuple[str, str]]:
        failures, self._failures = self._failures, []
        return failures

    def _fabric_lost(self, reason: str) -> None:
        """The fabric was abandoned (a post never returned): no message or write moves any
        more, so every request fails now instead of at its deadline. Pages that were offered
        to a prefill worker stay quarantined for good: its writes can still land (the memory
        stays registered), and no abort can be sent nor its answer received."""
        for request_id in list(self._by_id):
            self._fail(request_id, f"KV fabric unusable: {reason}")

    def _check_liveness(self) -> None:
        """Ask whether the prefill worker is still there for each address whose every live
        transfer had no write land since the last look: the fabric's record (a failed
        connection, an exited shm process), else, on ``tcp``, a connect to its listener (off
        this thread, `_probe`). A killed prefill process sends nothing, so without this its
        transfers would only end at their deadline; gone, they fail now (`_gone`) and the
        router can retry them elsewhere. A slow or paused prefill worker still accepts:
        its transfers wait, as before, for their writes or their deadline."""
        marks: dict[int, int] = {}
        stalled: dict[bytes, bool] = {}  # address -> no live transfer to it moved
        for incoming in self._by_id.values():
            transfer = incoming.transfer
            if transfer is None or transfer.state not in WAITING_FOR_WRITES:
                continue
            seen = self.fabric.imm_arrivals(transfer.imm)
            marks[transfer.imm] = seen
            moved = self._liveness_marks.get(transfer.imm) != seen  # a new one counts as moved
            address = incoming.endpoint.address
            stalled[address] = stalled.get(address, True) and not moved
        self._liveness_marks = marks
        for address, still in stalled.items():
            if still and (watch := self._askable(address, "liveness not checked")) is not None:
                self._probe(address, watch)

    def _admission_timeout(self, incoming: _Incoming) -> AdmissionTimeoutError:
        num_pages = self.engine.num_prefill_pages(len(incoming.prompt))
        block_manager = self.engine.block_manager
        waited = self.config.admission_timeout_s
        if waited is None:
            waited = self.config.transfer_timeout_s
        return AdmissionTimeoutError(
            f"admission deadline of {waited:g} s passed waiting for {num_pages} decode pages "
            f"({block_manager.num_free_pages} free) and a transfer slot "
            f"({self.slots.num_live} of {self.slots.capacity} live)"
        )

    def _handle_message(self, message: Message) -> None:
        try:
            decoded = decode_message(message.payload)
        except ProtocolError as error:
            log.warning("malformed message dropped: %s", error)
            return
        if isinstance(decoded, AbortAcknowledged):
            released = self.quarantine.acknowledge_abort(
                decoded.transfer_id, decoded.num_writes_submitted
            )
            self._release(released)
            return
        if not isinstance(decoded, PrefillAccepted | PrefillRejected | PrefillFailed):
            log.warning("unexpected %s", type(decoded).__name__)
            return
        incoming = self._by_id.get(decoded.request_id)
        transfer = incoming.transfer if incoming is not None else None
        if incoming is None or transfer is None or transfer.imm != decoded.transfer_id:
            if isinstance(decoded, PrefillRejected):  # nothing was or will be written
                self._release(self.quarantine.acknowledge_abort(decoded.transfer_id, 0))
            elif isinstance(decoded, PrefillFailed):  # no write after this: as an ack
                released = self.quarantine.acknowledge_abort(
                    decoded.transfer_id, decoded.num_writes_submitted
                )
                self._release(released)
            return
        if isinstance(decoded, PrefillFailed):
            detail = f": {decoded.detail}" if decoded.detail else ""
            self._fail(
                decoded.request_id,
                f"prefill worker failed the request ({decoded.reason.name}{detail})",
                prefill_writes=decoded.num_writes_submitted,
            )
            return
        if isinstance(decoded, PrefillRejected):
            self._fail(
                decoded.request_id,
                f"prefill worker rejected the request: {decoded.reason.name} {decoded.detail}",
                rejected=True,
            )
            return
        self._confirm_incarnation(incoming.endpoint)
        try:
            transfer.set_expected(decoded.expected_write_count)
        except KvTransferError as error:
            self._fail(decoded.request_id, f"write count disagreement: {error}")
            return
        if not incoming.armed:
            try:
                self._arm(incoming, decoded.expected_write_count)
            except FabricError as error:  # the fabric closed (this poll's `_fabric_lost` follows)
                self._fail(decoded.request_id, f"KV fabric unusable: {error}")

    def _handle_fired(self, imm: int, fired_s: float) -> None:
        request_id = self.slots.resolve(imm)
        incoming = self._by_id.get(request_id) if request_id is not None else None
        if request_id is None or incoming is None or incoming.transfer is None:
            return  # failed meanwhile; the quarantine counts it
        transfer = incoming.transfer
        slot, _ = self.imm_layout.decode(imm)
        if incoming.checksum_plan is not None:
            try:
                self._verify(incoming.checksum_plan, transfer.page_ids, slot)
            except KVChecksumError as error:
                # Every write landed (the counter fired): _fail frees the pages at once.
                self.num_checksum_failures += 1
                self._fail(request_id, str(error))
                self.finished[request_id]["checksum_mismatch"] = True
                return
            fired_s = time.monotonic()  # KV ready (usable) once verified: the cost shows
        transfer.count_reached(fired_s)
        self._confirm_incarnation(incoming.endpoint)  # every write came: it was accepted
        self.slots.release(imm)
        row = self.context[slot, : self._hidden_bytes].clone()
        self.context_states[request_id] = row.view(self.engine.dtype)
        while len(self.context_states) > self.config.finished_memory:
            self.context_states.popitem(last=False)
        del self._by_id[request_id]
        self._remember(request_id, transfer)
        try:
            self.engine.add_prefilled_request(
                request_id, incoming.prompt, incoming.params, list(transfer.page_ids)
            )
        except Exception as error:  # the KV is complete, so nothing can still land
            self.engine.free_pinned(transfer.page_ids)
            self._failures.append((request_id, f"engine refused the prefilled request: {error}"))

    def _verify(self, plan: TransferPlan, page_ids: tuple[int, ...], slot: int) -> None:
        row = self.context[slot].numpy()
        verify(
            plan,
            list(page_ids),
            self._pool_views,
            self.pools.layout,
            row[: self._hidden_bytes],
            row[self._hidden_bytes :],
        )

    def _fail(
        self,
        request_id: str,
        reason: str,
        *,
        aborted: bool = False,
        rejected: bool = False,
        prefill_writes: int | None = None,
        send_aborts: bool = True,
    ) -> None:
        """End a request: FAILED, counter cancelled, pages + slot quarantined. ``rejected``:
        nothing was written (free at once); ``prefill_writes``: the prefill side stopped after
        submitting that many writes (`PrefillFailed`: acknowledged; the AbortPrefill re-sends
        still watch the peer, whose death would leave that count unreachable); ``send_aborts``
        False: the caller frees the peer's pages next (`_gone`), so no AbortPrefill goes now."""
        incoming = self._by_id.pop(request_id)
        transfer = incoming.transfer
        if transfer is None:  # still pending (or its allocation failed): nothing to free
            if request_id in self._pending:
                self._pending.remove(request_id)
            if not aborted:
                self._failures.append((request_id, reason))
            return
        now = time.monotonic()
        imm = transfer.imm
        never_sent = transfer.state is DecodeState.ALLOCATED  # nothing can land
        still_armed = self.fabric.cancel_imm(imm)  # tombstoned: late writes count for nothing
        # An armed counter found disarmed fired (every write landed; its callback may not have
        # run yet), unless the fabric closed: that disarms every counter too (`fail_all`), with
        # writes still to come, so the pages stay held (closed is set before it disarms).
        fired = incoming.armed and not still_armed and self.fabric.closed_reason() is None
        transfer.fail(reason, now)
        self._remember(request_id, transfer)  # before any release, which it records
        self.slots.release(imm, drained=False)
        expected = transfer.num_writes_expected
        landed = self.fabric.take_imm_arrivals(imm)
        seen = expected if fired and expected else landed
        self._quarantined[imm] = seen
        released = self.quarantine.hold(
            QuarantinedPages(imm, request_id, transfer.page_ids, incoming.endpoint.address),
            num_writes_expected=expected or _UNKNOWN_COUNT,
            num_writes_seen=seen,
            now_s=now,
        )
        if rejected or never_sent:  # the request never reached the prefill worker's engine
            released += self.quarantine.acknowledge_abort(imm, 0)
        elif prefill_writes is not None:
            released += self.quarantine.acknowledge_abort(imm, prefill_writes)
        self._release(released)
        if send_aborts:
            self._send_aborts(now)  # the first AbortPrefill goes at once
        if not aborted:
            log.warning("request %s failed: %s", request_id, reason)
            self._failures.append((request_id, reason))

    def _tend_quarantine(self, now: float) -> None:
        """Count late arrivals, judge the prefill peers, re-send the aborts that are due."""
        released: list[QuarantinedPages] = []
        for imm in list(self._quarantined):
            landed = self.fabric.take_imm_arrivals(imm)
            if landed:
                self._quarantined[imm] += landed
                released += self.quarantine.record_writes(imm, landed)
        self._release(released)
        while True:
            try:
                address, error = self._abort_outcomes.get_nowait()
            except queue.Empty:
                break
            watch = self._watches.get(address)
            if watch is not None and watch.sent_s:
                watch.sent_s.popleft()
            if error is not None:
                self._judge(address, error)
        while True:
            try:
                address, gone = self._probe_results.get_nowait()
            except queue.Empty:
                break
            self._probed(address, gone)
        self._send_aborts(now)
        held = self.quarantine.peers()
        for address, watch in list(self._watches.items()):
            if address not in held and not watch.sent_s and not watch.probing:
                del self._watches[address]

    def _send_aborts(self, now: float) -> None:
        """(Re-)send AbortPrefill for each quarantined transfer that is due, unless its prefill
        process is known gone (then its pages are freed) or not taking messages (probed).
        None goes once the fabric is abandoned (`_fabric_lost`): the pages stay held."""
        if self.fabric.closed_reason() is not None:
            return
        for pages in self.quarantine.aborts_due(now):
            if pages.imm not in self.quarantine:
                continue  # freed by the judgement of an earlier one to the same address
            address = pages.peer
            watch = self._askable(address, f"AbortPrefill for {pages.request_id} not sent")
            if watch is None:
                continue
            if watch.sent_s and now - watch.sent_s[0] >= self._stall_s:
                self._probe(address, watch)  # an earlier abort neither completed nor failed
                continue
            try:
                self.fabric.submit_send(
                    self.fabric.add_peer(address),
                    encode_message(AbortPrefill(pages.request_id, pages.imm)),
                    on_done=partial(self._on_abort_sent, address, None),
                    on_error=partial(self._on_abort_sent, address),
                )
            except PeerFailedError as error:  # failed meanwhile: judged by the recorded cause
                cause = self.fabric.peer_failure(address)
                self._judge(address, cause or OperationTimeoutError(f"cause unknown: {error}"))
            except FabricError as error:
                self._judge(address, error)
            else:
                watch.sent_s.append(now)

    def _askable(self, address: bytes, what: str) -> _PeerWatch | None:
        """The watch of a prefill address that may be asked now; None when it was judged
        instead (nobody at the address any more, or a failure on record: `_judge`, where a
        missed deadline is only a reason to probe) or the fabric refused (logged as ``what``)."""
        try:
            watch = self._watch(address)
        except AddressError as error:  # resolved when the request went: nobody there now
            self._gone(address, error)
            return None
        except FabricError as error:
            log.warning("%s: %s", what, error)
            return None
        failure = self.fabric.peer_failure(address)
        if failure is not None:
            self._judge(address, failure)
            return None
        return watch

    def _watch(self, address: bytes) -> _PeerWatch:
        watch = self._watches.get(address)
        if watch is None:
            watch = _PeerWatch(self.fabric.add_peer(address).name, deque())
            self._watches[address] = watch
        return watch

    def _gone(self, address: bytes, why: object) -> None:
        """The prefill process at ``address`` is gone, so no write from it can land any more:
        its live transfers fail (their KV will never arrive) and its quarantined pages are
        freed, theirs included."""
        watch = self._watches.get(address)
        name = watch.name if watch is not None else address.hex()
        log.info("prefill worker %s gone (%s): its transfers end, their pages are freed", name, why)
        live = [
            request_id
            for request_id, incoming in self._by_id.items()
            if incoming.transfer is not None and incoming.endpoint.address == address
        ]
        for request_id in live:  # no AbortPrefill: it would judge the peer again, per request
            reason = f"prefill worker gone ({why}): its KV will never arrive"
            self._fail(request_id, reason, send_aborts=False)
        self._release(self.quarantine.peer_gone(address), "peer_gone")

    def _on_abort_sent(self, address: bytes, error: FabricError | None) -> None:
        self._abort_outcomes.put((address, error))  # fabric callback thread: enqueue only
        self._wake()

    def _judge(self, address: bytes, error: FabricError) -> None:
        """Free the address's quarantined pages if ``error`` proves its process gone."""
        if isinstance(error, OperationTimeoutError):
            watch = self._watches.get(address)
            if watch is not None:
                self._probe(address, watch)  # stopped and dead peers both miss deadlines
        elif isinstance(error, PeerFailedError):  # connection failed or process exited
            self._gone(address, error)
        else:
            log.info("AbortPrefill not sent: %s", error)

    def _probe(self, address: bytes, watch: _PeerWatch) -> None:
        """Ask (off the step thread) whether anything still listens at the peer's address."""
        if watch.probing or tcp_address(watch.name) is None:
            return
        watch.probing = True

        def probe() -> None:
            self._probe_results.put((address, listener_refuses(watch.name)))
            self._wake()

        threading.Thread(target=probe, name="kv-peer-probe", daemon=True).start()

    def _probed(self, address: bytes, gone: bool) -> None:
        watch = self._watches.get(address)
        if watch is not None:
            watch.probing = False
        if gone:
            self._gone(address, "nothing listens at its address")
            return
        if isinstance(self.fabric.peer_failure(address), OperationTimeoutError):
            # Alive but missed a deadline (stopped, slow): send to it afresh next time.
            self.fabric.forget_peer(address)
            if watch is not None:
                watch.sent_s.clear()

    def _release(self, released: list[QuarantinedPages], how: str = "drained") -> None:
        """Free quarantined pages; ``how``: every write that can land did (``drained``), or
        the prefill process is gone (``peer_gone``), recorded in the transfer's record."""
        for pages in released:
            landed = self._quarantined.pop(pages.imm, 0) + self.fabric.take_imm_arrivals(pages.imm)
            record = self.finished.get(pages.request_id)
            if record is not None and record["imm"] == pages.imm:
                record["quarantine_release"] = how
                record["num_writes_landed"] = landed
            self.engine.free_pinned(pages.page_ids)
            self.slots.recycle(pages.imm)

    def _remember(self, request_id: str, transfer: DecodeTransfer) -> None:
        self.finished[request_id] = {
            "imm": transfer.imm,
            "state": transfer.state.value,
            "reason": transfer.failure_reason,
            "num_writes_expected": transfer.num_writes_expected,
            "requested_s": transfer.entered_at(DecodeState.REQUESTED),
            "kv_ready_s": transfer.stats.kv_ready_s,
            "page_ids": list(transfer.page_ids),
        }
        while len(self.finished) > self.config.finished_memory:
            self.finished.popitem(last=False)

    def progress(self, request_id: str) -> tuple[int, int | None] | None:
        """``(writes landed, writes expected)`` of a transfer in flight, None when there is none."""
        incoming = self._by_id.get(request_id)
        if incoming is None or incoming.transfer is None:
            return None
        transfer = incoming.transfer
        return self.fabric.imm_arrivals(transfer.imm), transfer.num_writes_expected

    def state(self) -> dict[str, Any]:
        by_state: dict[str, int] = {}
        for incoming in self._by_id.values():
            name = incoming.transfer.state.value if incoming.transfer else "pending"
            by_state[name] = by_state.get(name, 0) + 1
        return {
            "num_transfers": len(self._by_id),
            "transfers_by_state": by_state,
            "num_quarantined_pages": self.quarantine.num_pages,
            "num_parked_slots": self.slots.num_parked,
            "num_checksum_failures": self.num_checksum_failures,
        }

    def close(self) -> None:
        self.fabric.on_message(None)
