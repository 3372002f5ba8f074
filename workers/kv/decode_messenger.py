"""Decode side of the KV messenger: reserve pages, ask a prefill worker to fill them, admit.

Queues and life cycle (keyed by request id)::

    start() ──▶ pending (no pages / slot yet) ──▶ ALLOCATED (pinned pages, imm slot, context row)
      ──PrefillRequest──▶ REQUESTED ──PrefillAccepted(count): arm counter──▶ counter fires
      ──▶ READY: slot released, engine.add_prefilled_request (the last prompt token runs first)
    deadline / PrefillRejected / PrefillFailed / abort ──▶ FAILED: counter cancelled, pages +
      slot ──▶ quarantine (AbortPrefill re-sent every drain interval)
      ──(all writes landed | acknowledged count landed | prefill process gone)──▶ free

- A one-token prompt has no KV to prefill: it goes to the engine at once.
- **Prefix cache** (decode engine with ``enable_prefix_caching``): when a request leaves
  pending, the cached pages of its prompt's longest cached prefix are shared with it
  (`EngineCore.acquire_cached_prefix`); only the pages after them are pinned and asked for
  (`PrefillRequest.skip_pages`), and the count covers only those. A prompt whose KV is all
  cached goes to the engine at once. The cached pages are never written by the transfer, so a
  failed one gives them back at once (only its pinned pages are quarantined).
- A pending request waits at most ``admission_timeout_s`` (default: the transfer deadline) for
  its pages and slot, then fails (`AdmissionTimeoutError`'s message); it holds nothing yet, so
  nothing is freed.
- A prefill worker that fails a transfer it accepted sends `PrefillFailed` (reason and the
  number of writes it submitted): the request fails at once and its pages are quarantined as
  on an abort, released when that many writes landed (or the prefill process is gone).
- A prefill process that dies sends nothing: every ``liveness_interval_s`` the prefill worker
  of each address whose live transfers had no write land since the last look is checked
  (`workers.kv.peer_liveness`); gone, its transfers fail at once and their pages are freed
  (`_gone`), long before their deadline.
- **Quarantine** (`workers.kv.quarantine`, `workers.kv.decode_quarantine`): time never frees
  pages, since a paused prefill process can post a write long after any deadline. Every
  ``drain_interval_s`` the decoder re-sends `AbortPrefill` for each quarantined transfer
  (`workers.kv.abort_resend`); the prefill worker answers with its submitted count
  (`AbortAcknowledged`), also for a transfer it ended or never saw (0). Its process counts as
  gone (pages freed) only on evidence (`workers.kv.peer_liveness`): a failed connection, an
  exited process, nothing listening at its ``tcp`` address. An endpoint naming another
  incarnation frees nothing (`workers.kv.prefill_peers`). A paused prefill process keeps its
  pages quarantined (capacity, never corruption) until it answers or is replaced.
- The request stays out of decode scheduling (its pages are pinned, the engine does not know
  it) until the counter reached the expected count.
- The expected count is the plan's (`workers.kv.writes`; who knows it: `workers.kv.incoming`);
  writes landing before the counter is armed are buffered by it.
- Late writes of a failed transfer cannot count for a newer one: the imm carries generation
  bits, the slot is parked and the pages quarantined until the old writes drained.
- **Checksum mode** (``checksum=True``, `workers.kv.checksum`): when the counter fires (so the
  sums in the context row have landed, `workers.kv.decode_context`) the decoder recomputes them
  over the pages it received; a mismatch fails the request (`KVChecksumError`'s message, never
  tokens), frees its pages at once (every write landed), counts in ``num_checksum_failures``.

Threads: `start`, `abort`, `poll` run on the worker's step thread; fabric callbacks only enqueue,
and so does a liveness probe (a short-lived thread: a connect may take up to its timeout).
"""

from __future__ import annotations

import logging
import queue
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from workers.engine.engine_core import EngineCore
from workers.engine.sampling_params import SamplingParams
from workers.fabric import FabricError, Message, TransferEngine
from workers.kv.abort_resend import AbortResender, resend_interval_s
from workers.kv.decode_context import ContextRows
from workers.kv.decode_quarantine import QuarantineLedger
from workers.kv.decode_table import DecodeTable
from workers.kv.endpoint import PrefillEndpoint
from workers.kv.errors import (
    AdmissionTimeoutError,
    KVChecksumError,
    KvTransferError,
    ProtocolError,
    UnauthenticatedMessageError,
)
from workers.kv.imm import ImmLayout, SlotTable
from workers.kv.incoming import Incoming, NicAdvert, RequestPlanner
from workers.kv.peer_liveness import PeerLiveness, proves_gone
from workers.kv.pools import register_engine_pools, register_extra_nics
from workers.kv.prefill_peers import PrefillPeers
from workers.kv.protocol import (
    AbortAcknowledged,
    PrefillAccepted,
    PrefillFailed,
    PrefillRejected,
    decode_message,
    encode_message,
)
from workers.kv.quarantine import PageQuarantine, QuarantinedPages
from workers.kv.sharding import GroupSharding
from workers.kv.transfer_state import DecodeState, DecodeTransfer

log = logging.getLogger(__name__)


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
    # are checked for being gone (`PeerLiveness.check_stalled`); 0: only the deadline ends them.
    liveness_interval_s: float = 1.0
    max_transfers: int = 256  # imm slots and rows of the context buffer
    coalesce_pages: bool = True
    finished_memory: int = 4096
    seed: int = 0
    # Checksum mode: verify every transfer's KV against the prefill's sums (costs one read of
    # the received KV on the step thread per request, and CRC-32 on the prefill's push thread).
    checksum: bool = False
    # The cluster's secret: every control message carries its MAC, and one without is refused
    # (`workers.kv.protocol`). None: messages are not authenticated.
    secret: bytes | None = None

    @property
    def admission_s(self) -> float:
        """The admission deadline: ``admission_timeout_s``, else the transfer deadline."""
        if self.admission_timeout_s is None:
            return self.transfer_timeout_s
        return self.admission_timeout_s


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
        extra_nics: Sequence[TransferEngine] = (),
    ) -> None:
        """``extra_nics``: the engines of this rank's other NICs, sharing ``fabric``'s counters
        (`workers.fabric.NicSet`): the pools are registered with each and every
        `PrefillRequest` names them, so a prefill worker may write through any of them; the
        request's one counter counts the writes landing on all."""
        self.engine = engine
        self.fabric = fabric
        self.config = config = config or DecodeMessengerConfig()
        self.sharding, self.geometry, self.pools = register_engine_pools(
            fabric, engine, rank_pools, sharding
        )
        self.extra_pools = register_extra_nics(
            fabric, extra_nics, rank_pools or [engine.kv_cache], self.pools.layout
        )
        self._context = ContextRows(
            fabric,
            engine,
            self.sharding,
            self.pools.layout,
            config.max_transfers,
            checksum=config.checksum,
            rank_pools=rank_pools,
        )
        self.context = self._context.buffer
        self.num_checksum_failures = 0
        # Prompt pages asked of prefill workers, and those found in the prefix cache instead.
        self.num_pages_requested = 0
        self.num_pages_skipped = 0
        # Control messages refused for a missing or wrong MAC (`workers.kv.protocol`).
        self.num_unauthenticated_messages = 0
        self.imm_layout = ImmLayout()
        self.imm_layout.check_provider(fabric.imm_bits // 8)
        self.slots = SlotTable(self.imm_layout, config.max_transfers)
        self.quarantine = PageQuarantine(resend_interval_s(config.drain_interval_s))
        self._wake = wake or (lambda: None)
        self._liveness = PeerLiveness(fabric, self._gone, self._wake)
        self._aborts = AbortResender(
            fabric,
            self.quarantine,
            self._liveness,
            config.drain_interval_s,
            self._wake,
            config.secret,
        )
        self._next_liveness_s = 0.0  # when the prefill workers of stalled transfers are checked
        self._ledger = QuarantineLedger(fabric, self.quarantine, self._freed)
        # This registration's id, sent in each PrefillRequest (a restart draws anew), and the
        # incarnation last confirmed at each prefill address.
        self.incarnation = random.SystemRandom().getrandbits(64) or 1
        self._peers = PrefillPeers(fabric)
        self.peer_incarnations = self._peers.incarnations
        self._planner = RequestPlanner(
            fabric,
            self.sharding,
            self.geometry,
            self.pools,
            self._context,
            coalesce_pages=config.coalesce_pages,
            checksum=config.checksum,
            transfer_timeout_s=config.transfer_timeout_s,
            rng=random.Random(config.seed),
            mtp_layers=engine.kv_layers - engine.model_config.num_layers,
            extra_nics=NicAdvert(
                tuple(nic.address for nic in extra_nics),
                tuple(pools.descriptor_bytes() for pools in self.extra_pools),
            ),
        )
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        # (imm, when its counter fired): the fire time is the KV-ready time of the measurements.
        self._fired: queue.SimpleQueue[tuple[int, float]] = queue.SimpleQueue()
        self._table = DecodeTable(config.finished_memory)
        self._by_id, self._pending = self._table.by_id, self._table.pending
        self.finished, self.context_states = self._table.finished, self._table.context_states
        self._failures: list[tuple[str, str]] = []
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
        self._by_id[request_id] = Incoming(
            list(prompt), params, endpoint, time.monotonic() + self.config.admission_s
        )
        self._pending.append(request_id)
        self._start_pending()

    def _start_pending(self) -> None:
        engine = self.engine
        while self._pending:
            incoming = self._by_id[self._pending[0]]
            if self.slots.num_live >= self.slots.capacity:
                return
            # The prompt's cached prefix (decode role with prefix caching) is not asked for.
            cached = engine.acquire_cached_prefix(incoming.prompt, incoming.page_hashes)
            num_pages = engine.num_prefill_pages(len(incoming.prompt)) - len(cached)
            if not engine.block_manager.can_allocate(num_pages + self._reserve(incoming)):
                engine.release_cached(cached)
                return
            request_id = self._pending.popleft()
            incoming.cached_pages = cached
            self.num_pages_skipped += len(cached)
            engine.count_cached_prefix(len(incoming.prompt), len(cached))
            if num_pages == 0:  # every page of the prompt's KV is here: nothing to transfer
                del self._by_id[request_id]
                self._admit(request_id, incoming, (), None)
                continue
            try:
                self._request(request_id, incoming, num_pages)
            except (KvTransferError, FabricError) as error:
                self._fail(request_id, f"could not request the KV: {error}")

    def _reserve(self, incoming: Incoming) -> int:
        """Pages to keep free beside a new prompt's pinned ones: what it and every other live
        request (in the engine, or with a transfer in flight) still take before they finish.
        Without them a running answer that needs a page would preempt another by recompute,
        and the decoder would prefill that prompt again itself, beside the prefill workers
        and ahead of its own decode steps: under overload more prompts wait, more pages are
        pinned, more answers are recomputed, and throughput falls instead of levelling off
        (bench/history/RESULTS-notebook.md, "Goodput in steady state, and a decoder that
        recomputed its own prompts"). 0 when nothing else is live: a request that outgrows
        the pool alone still starts, and ends at ``length`` as before."""
        engine = self.engine
        transfers = [(i, i.transfer) for i in self._by_id.values() if i.transfer is not None]
        if not transfers and not engine.scheduler.has_work():
            return 0
        in_flight = sum(
            max(
                0,
                engine.final_pages(len(i.prompt), i.params.max_tokens)
                - len(i.cached_pages)
                - len(transfer.page_ids),
            )
            for i, transfer in transfers
        )
        own = engine.final_pages(len(incoming.prompt), incoming.params.max_tokens)
        own -= engine.num_prefill_pages(len(incoming.prompt))
        return engine.num_pages_to_finish() + in_flight + own

    def _request(self, request_id: str, incoming: Incoming, num_pages: int) -> None:
        now = time.monotonic()
        pages = self.engine.allocate_pinned(num_pages)  # can_allocate and num_live were checked
        try:
            imm = self.slots.allocate(request_id)
        except KvTransferError:
            self.engine.free_pinned(pages)
            raise
        self.num_pages_requested += num_pages
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
        endpoint = incoming.endpoint
        incoming.peer = self._peers.peer(endpoint)  # afresh for a new incarnation
        planned = self._planner.plan(
            request_id,
            imm,
            slot,
            incoming.prompt,
            pages,
            endpoint,
            self.incarnation,
            skip_pages=len(incoming.cached_pages),
        )
        incoming.checksum_plan = planned.checksum_plan
        if planned.expected:  # computed here: armed before the request goes
            incoming.transfer.set_expected(planned.expected)
            self._arm(incoming, planned.expected)
        self.fabric.submit_send(incoming.peer, encode_message(planned.message, self.config.secret))
        incoming.transfer.advance(DecodeState.REQUESTED, now)

    def _arm(self, incoming: Incoming, count: int) -> None:
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
            # A killed prefill process sends nothing: without this look its transfers would
            # only end at their deadline; gone, they fail now (`_gone`), retried elsewhere.
            self._next_liveness_s = now + interval
            self._liveness.check_stalled(self._table.waiting_for_writes())
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
        stays registered), and no abort can be sent nor its answer received; except pages
        offered to a prefill process the fabric found gone (on shm, the post that never
        returned may be to a peer killed while it held its lock): they are freed (`_gone`)."""
        addresses = {incoming.endpoint.address for incoming in self._by_id.values()}
        for address in addresses | self.quarantine.peers():
            failure = self.fabric.peer_failure(address)
            if proves_gone(failure):
                self._gone(address, failure)
        for request_id in list(self._by_id):
            self._fail(request_id, f"KV fabric unusable: {reason}")

    def _admission_timeout(self, incoming: Incoming) -> AdmissionTimeoutError:
        num_pages = self.engine.num_prefill_pages(len(incoming.prompt))
        block_manager = self.engine.block_manager
        return AdmissionTimeoutError(
            f"admission deadline of {self.config.admission_s:g} s passed waiting for "
            f"{num_pages} decode pages ({block_manager.num_free_pages} free) and a transfer slot "
            f"({self.slots.num_live} of {self.slots.capacity} live)"
        )

    def _handle_message(self, message: Message) -> None:
        try:
            decoded = decode_message(message.payload, self.config.secret)
        except UnauthenticatedMessageError as error:
            self.num_unauthenticated_messages += 1
            log.warning("refused a message: %s", error)
            return
        except ProtocolError as error:
            log.warning("malformed message dropped: %s", error)
            return
        if isinstance(decoded, AbortAcknowledged):
            self._ledger.acknowledge(decoded.transfer_id, decoded.num_writes_submitted)
            return
        if not isinstance(decoded, PrefillAccepted | PrefillRejected | PrefillFailed):
            log.warning("unexpected %s", type(decoded).__name__)
            return
        incoming = self._by_id.get(decoded.request_id)
        transfer = incoming.transfer if incoming is not None else None
        if incoming is None or transfer is None or transfer.imm != decoded.transfer_id:
            if isinstance(decoded, PrefillRejected):  # nothing was or will be written
                self._ledger.acknowledge(decoded.transfer_id, 0)
            elif isinstance(decoded, PrefillFailed):  # no write after this: as an ack
                self._ledger.acknowledge(decoded.transfer_id, decoded.num_writes_submitted)
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
        self._peers.confirm(incoming.endpoint)
        try:
            transfer.set_expected(decoded.expected_write_count)
        except KvTransferError as error:
            self._fail(decoded.request_id, f"write count disagreement: {error}")
            return
        if not incoming.armed:
            try:
                self._arm(incoming, decoded.expected_write_count)
            except FabricError as error:
                if self.fabric.closed_reason() is None:
                    self._fail(decoded.request_id, f"KV fabric unusable: {error}")
                # Else this poll's `_fabric_lost` follows: it first frees the transfers of a
                # prefill process the fabric found gone, failed as such.

    def _handle_fired(self, imm: int, fired_s: float) -> None:
        request_id = self.slots.resolve(imm)
        incoming = self._by_id.get(request_id) if request_id is not None else None
        if request_id is None or incoming is None or incoming.transfer is None:
            return  # failed meanwhile; the quarantine counts it
        transfer = incoming.transfer
        slot, _ = self.imm_layout.decode(imm)
        if incoming.checksum_plan is not None:
            try:
                self._context.verify(incoming.checksum_plan, transfer.page_ids, slot)
            except KVChecksumError as error:
                # Every write landed (the counter fired): _fail frees the pages at once.
                self.num_checksum_failures += 1
                self._fail(request_id, str(error))
                self.finished[request_id]["checksum_mismatch"] = True
                return
            fired_s = time.monotonic()  # KV ready (usable) once verified: the cost shows
        transfer.count_reached(fired_s)
        self._peers.confirm(incoming.endpoint)  # every write came: it was accepted
        self.slots.release(imm)
        hidden_state = self._context.hidden_state(slot)
        self._table.keep_context(request_id, hidden_state)
        del self._by_id[request_id]
        self._table.remember(request_id, transfer, len(incoming.cached_pages))
        self._admit(request_id, incoming, transfer.page_ids, hidden_state)

    def _admit(
        self,
        request_id: str,
        incoming: Incoming,
        pinned: Sequence[int],
        hidden_state: Any,
    ) -> None:
        """Hand a request whose KV is all here (its cached pages, then the ``pinned`` ones that
        were written) to the engine."""
        cached = incoming.cached_pages
        try:
            self.engine.add_prefilled_request(
                request_id,
                incoming.prompt,
                incoming.params,
                [*cached, *pinned],
                hidden_state,
                num_cached_pages=len(cached),
            )
        except Exception as error:  # the KV is complete, so nothing can still land
            self.engine.free_pinned(pinned)
            self.engine.release_cached(cached)
            self._failures.append((request_id, f"engine refused the prefilled request: {error}"))

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
        # Cached pages are the decoder's own: no write of the transfer targets them.
        num_skipped = len(incoming.cached_pages)
        self.engine.release_cached(incoming.cached_pages)
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
        # Before any release, which it records.
        self._table.remember(request_id, transfer, num_skipped)
        self.slots.release(imm, drained=False)
        self._ledger.hold(
            QuarantinedPages(imm, request_id, transfer.page_ids, incoming.endpoint.address),
            num_writes_expected=transfer.num_writes_expected,
            fired=fired,
            # Never reached the prefill worker's engine: nothing was or will be written.
            acknowledged=0 if rejected or never_sent else prefill_writes,
            now_s=now,
        )
        if send_aborts:
            self._aborts.send_due(now)  # the first AbortPrefill goes at once
        if not aborted:
            log.warning("request %s failed: %s", request_id, reason)
            self._failures.append((request_id, reason))

    def _tend_quarantine(self, now: float) -> None:
        """Count late arrivals, judge the prefill peers, re-send the aborts that are due."""
        self._ledger.count_arrivals()
        self._aborts.take_outcomes()
        self._liveness.take_probe_results()
        self._aborts.send_due(now)
        self._liveness.forget_idle(self.quarantine.peers())

    def _gone(self, address: bytes, why: object) -> None:
        """The prefill process at ``address`` is gone, so no write from it can land any more:
        its live transfers fail (their KV will never arrive) and its quarantined pages are
        freed, theirs included."""
        name = self._liveness.name_of(address)
        log.info("prefill worker %s gone (%s): its transfers end, their pages are freed", name, why)
        for request_id in self._table.holding_pages_of(
            address
        ):  # no AbortPrefill: it would judge the peer again, per request
            reason = f"prefill worker gone ({why}): its KV will never arrive"
            self._fail(request_id, reason, send_aborts=False)
        self._ledger.peer_gone(address)

    def _freed(self, pages: QuarantinedPages, how: str, landed: int) -> None:
        """Quarantined pages released (`QuarantineLedger`); ``how``: every write that can land
        did (``drained``), or the prefill process is gone (``peer_gone``), recorded in the
        transfer's record with the writes that landed."""
        record = self.finished.get(pages.request_id)
        if record is not None and record["imm"] == pages.imm:
            record["quarantine_release"] = how
            record["num_writes_landed"] = landed
        self.engine.free_pinned(pages.page_ids)
        self.slots.recycle(pages.imm)

    def progress(self, request_id: str) -> tuple[int, int | None] | None:
        """``(writes landed, writes expected)`` of a transfer in flight, None when there is none."""
        incoming = self._by_id.get(request_id)
        if incoming is None or incoming.transfer is None:
            return None
        transfer = incoming.transfer
        return self.fabric.imm_arrivals(transfer.imm), transfer.num_writes_expected

    def state(self) -> dict[str, Any]:
        return {
            "num_transfers": len(self._by_id),
            "transfers_by_state": self._table.count_by_state(),
            "num_quarantined_pages": self.quarantine.num_pages,
            "num_parked_slots": self.slots.num_parked,
            "num_checksum_failures": self.num_checksum_failures,
            "num_pages_requested": self.num_pages_requested,
            "num_pages_skipped": self.num_pages_skipped,
            "num_unauthenticated_messages": self.num_unauthenticated_messages,
        }

    def close(self) -> None:
        self.fabric.on_message(None)
