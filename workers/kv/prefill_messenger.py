"""Prefill side of the KV messenger: decoders' requests in, KV pages out, layer by layer.

Queues and life cycle (all keyed by the decoder's request id)::

    fabric callback ──message──▶ inbox ──poll()──▶ validate ──▶ queued ──admit──▶ engine
      (PrefillRequest / AbortPrefill)                   └──▶ PrefillRejected
    engine.on_step_scheduled(chunks) ──▶ PassPlan ──▶ push thread (writes per finished layer)
    final-norm forward hook (pass end) ──▶ context write (hidden state of last prefilled position)
                                       + the pass's writes not sent yet (`PushThread.pass_ended`)
    fabric on_done / on_error ──▶ events ──poll()──▶ all writes completed ──▶ engine.release

- **queued**: accepted, waiting for source pages. A request is admitted to the engine only when
  the pages of its whole prompt are free next to every admitted request's, so the prefill
  scheduler never preempts (a recomputed chunk would be written twice).
- Each pass is planned and ended by the engine hooks (`workers.kv.prefill_hooks`), which also
  send **PrefillAccepted** with the exact write count once the last chunk is scheduled.
- No done message: when every write completed locally the pages are released.
- **Abort** (`AbortPrefill`): a queued request is dropped; a running one stops submitting,
  its in-flight writes drain, then the engine request is aborted (pages freed);
  `AbortAcknowledged(num_writes_submitted)` goes back at once. The decoder re-sends the abort
  until its pages are freed, so every copy is answered: for a transfer that already ended with
  its count (kept for ``finished_memory`` transfers), for one never seen (or forgotten: its
  writes all completed long ago) with 0. **Deadline** (the request's ``timeout_ms``): same as
  an abort, marked failed; no write is submitted after it. A new request reusing the id of one
  aborted in the engine stays queued until that one's final output came (one engine step).
- **Giving up** (deadline, a failed write, the engine ending the request, `shutdown`, the
  step loop dying: `engine_failed`): the transfer stops as on an abort and
  `PrefillFailed(reason, num_writes_submitted)` goes to the decoder at once, so it fails the
  request without waiting for its own deadline. Writes are counted before they are posted;
  those the fabric refuses at once (queue full, peer failed, engine closed) are taken back out
  of the count first (`workers.kv.submit_gate`), then the transfer is given up: a count
  reported never names a write that cannot land.
- A message from a decoder the fabric marked failed proves it alive: the peer is resolved
  afresh (`workers.kv.decoder_peers`), else every later answer and write to it would fail.
  `shutdown` (the worker's graceful close) also rejects new requests (DRAINING); the worker
  then waits, bounded, until in-flight writes and these messages completed (`is_drained`).
- **Checksum mode** (the decoder's `PrefillRequest.checksum`, `workers.kv.checksum`): the push
  thread sums the bytes of every write it posts; the context write carries the sums.

Parts: `PrefillSide` (what this worker is, fixed at start), `check_request` /
`check_checksums` (`workers.kv.prefill_checks`), `PrefillTable` (the transfers and their lock),
`PassHooks` (the engine hooks), `ContextWriter` (the hidden-state write), `PushThread` and
`SubmitGate` (layer writes and their count), `DecoderPeers`, `ControlSender` (messages to
decoders).

Threads: `poll`, the engine hooks and `after_step` run on the worker's step thread (the only
one touching the engine; once it died, `poll` runs on the thread that took the messenger over,
and the engine is not touched again); the push thread calls `SubmitGate.gate`; fabric
callbacks only enqueue. Transfer state is shared under one lock (`PrefillTable.lock`).
"""

from __future__ import annotations

import logging
import queue
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from workers.engine.engine_core import EngineCore
from workers.engine.errors import CapacityError, EngineError, InvalidRequestError
from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import SamplingParams
from workers.fabric import FabricError, Message, PeerHandle, TransferEngine
from workers.kv.context_write import ContextWriter
from workers.kv.control_sender import ControlSender
from workers.kv.decoder_peers import DecoderPeers
from workers.kv.errors import ProtocolError, UnauthenticatedMessageError
from workers.kv.nic_lanes import LanePicker
from workers.kv.outgoing import Outgoing
from workers.kv.pages import num_pages_for_tokens
from workers.kv.prefill_checks import RequestRejected, check_checksums, check_request
from workers.kv.prefill_hooks import PassHooks
from workers.kv.prefill_side import PrefillSide
from workers.kv.prefill_table import PrefillTable
from workers.kv.protocol import (
    AbortAcknowledged,
    AbortPrefill,
    FailReason,
    PrefillFailed,
    PrefillRejected,
    PrefillRequest,
    RejectReason,
    decode_message,
    truncate_detail,
)
from workers.kv.push import PushItem, PushThread, SourceNic
from workers.kv.sharding import GroupSharding
from workers.kv.submit_gate import SubmitGate
from workers.kv.transfer_state import PrefillState, PrefillTransfer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillMessengerConfig:
    max_transfers: int = 256  # live transfers (and rows of the context staging buffer)
    finished_memory: int = 4096  # ended transfers remembered for late aborts and stats
    poll_interval_s: float = 0.0001  # push thread's poll of a counter that cannot notify (CUDA)
    layerwise: bool = True  # False: push a pass's writes only once it ended (bench baseline)
    seed: int = 0
    # Checksum mode: room per context staging row for this many shards' sums (4 bytes each);
    # a request whose plan has more is rejected (INCOMPATIBLE).
    max_checksum_shards: int = 64
    # NAMED TEST FAULT, never set in production: for these request ids (checksum mode), one
    # source byte is flipped after it was summed and before it is posted (a byte corrupted in
    # flight, which a loopback fabric cannot produce), so the decoder must fail the request.
    fault_flip_after_checksum: tuple[str, ...] = ()
    # The cluster's secret: every control message carries its MAC, and one without is refused
    # (`workers.kv.protocol`). None: messages are not authenticated.
    secret: bytes | None = None


class PrefillMessenger:
    def __init__(
        self,
        engine: EngineCore,
        fabric: TransferEngine,
        config: PrefillMessengerConfig | None = None,
        *,
        rank_pools: Sequence[object] | None = None,
        sharding: GroupSharding | None = None,
        wake: Callable[[], None] | None = None,
        extra_nics: Sequence[TransferEngine] = (),
    ) -> None:
        """``rank_pools``: every TP rank's KV pool in rank order (default: the engine's own).
        ``extra_nics``: the engines of this rank's other NICs, sharing ``fabric``'s counters
        (`workers.fabric.NicSet`); each request's page writes go through one of the NICs
        (`workers.kv.nic_lanes`)."""
        self.engine = engine
        self.fabric = fabric
        self.config = config = config or PrefillMessengerConfig()
        self.side = side = PrefillSide.wire(engine, fabric, rank_pools, sharding, extra_nics)
        self.sharding, self.geometry, self.pools = side.sharding, side.geometry, side.pools
        self.incarnation = side.incarnation
        self._decoders = DecoderPeers(fabric)
        self.decoder_incarnations = self._decoders.incarnations  # decoder address -> its last
        self._rng = random.Random(config.seed)
        self._lanes = LanePicker(side.nics)
        self._wake = wake or (lambda: None)
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._events: queue.SimpleQueue[tuple[str, int, FabricError | None]] = queue.SimpleQueue()
        self._table = PrefillTable(config.finished_memory)
        self.finished = self._table.finished
        self._submits = SubmitGate(self._table, lambda: self._wake())
        # Why new requests are refused (None while serving): draining, or the engine failed.
        self._refusal: tuple[RejectReason, str] | None = None
        self._engine_failed = False
        self._control = ControlSender(fabric, config.secret)
        # Control messages refused for a missing or wrong MAC (`workers.kv.protocol`).
        self.num_unauthenticated_messages = 0
        self._context = ContextWriter(
            side,
            config.max_transfers,
            config.max_checksum_shards,
            on_done=self._on_write_done,
            on_error=self._on_write_error,
            refused=self._submits.not_posted,
            unposted=self._submits.context_not_posted,
        )
        self._push = PushThread(
            fabric,
            side.pools.handles,
            engine.layer_progress,
            side.geometry.num_layers,
            self._submits.gate,
            self._on_write_done,
            self._on_write_error,
            poll_interval_s=config.poll_interval_s,
            layerwise=config.layerwise,
            src_views=side.src_views,
            on_checksummed=self._on_checksummed,
            on_not_posted=self._submits.item_not_posted,
            extra_nics=[
                SourceNic(nic, pools.handles)
                for nic, pools in zip(side.extra_nics, side.extra_pools, strict=True)
            ],
        )
        self._hooks = PassHooks(
            side,
            self._table,
            self._push,
            self._context,
            send=self._control.send,
            finish_if_drained=self._finish_if_drained,
            give_up=self._give_up,
        )
        fabric.on_message(self._on_message)

    # -- fabric callbacks (callback thread: enqueue only) ------------------------------------

    def _on_message(self, message: Message) -> None:
        self._inbox.put(message)
        self._wake()

    def _on_write_done(self, request_id: str, count: int) -> None:
        self._events.put((request_id, count, None))
        self._wake()

    def _on_write_error(self, request_id: str, count: int, error: FabricError) -> None:
        self._events.put((request_id, count, error))
        self._wake()

    # -- step thread ----------------------------------------------------------------------------

    def has_work(self) -> bool:
        queues = (self._inbox, self._events, self._submits.not_posted_events)
        return bool(self._table.by_id) or any(not pending.empty() for pending in queues)

    def poll(self) -> None:
        """Handle messages and completions, expire deadlines, admit queued requests."""
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                break
            self._handle_message(message)
        while True:
            try:
                request_id, count, error = self._events.get_nowait()
            except queue.Empty:
                break
            self._handle_completion(request_id, count, error)
        while True:
            try:
                request_id, imm, error = self._submits.not_posted_events.get_nowait()
            except queue.Empty:
                break
            self._handle_not_posted(request_id, imm, error)
        now = time.monotonic()
        for out in list(self._table.by_id.values()):
            if out.active and now >= out.deadline_s:
                log.warning("prefill transfer %s missed its deadline", out.request.request_id)
                self._give_up(out, FailReason.DEADLINE, "deadline passed on the prefill side")
        self._admit()

    def after_step(self, outputs: list[RequestOutput]) -> None:
        """After the step: requests the engine reports prefilled may be freed once drained."""
        self._hooks.after_step(outputs)

    # -- push thread ----------------------------------------------------------------------------

    def _on_checksummed(self, item: PushItem) -> None:
        """Push thread: every layer of the request is summed; the context write may go."""
        with self._table.lock:
            out = self._table.live(item.request_id, item.imm)
            if out is not None:
                self._context.post_if_ready(out, time.monotonic())

    # -- messages -------------------------------------------------------------------------------

    def _handle_message(self, message: Message) -> None:
        try:
            peer = self._decoders.sender(message.source)
        except FabricError as error:
            log.warning("message from an unreachable peer dropped: %s", error)
            return
        try:
            decoded = decode_message(message.payload, self.config.secret)
        except UnauthenticatedMessageError as error:
            self.num_unauthenticated_messages += 1  # not answered: the sender is no peer
            log.warning("refused a message from %s: %s", peer.name, error)
            return
        except ProtocolError as error:
            log.warning("malformed message from %s: %s", peer.name, error)
            return
        if isinstance(decoded, PrefillRequest):
            self._handle_request(decoded, peer)
        elif isinstance(decoded, AbortPrefill):
            self._handle_abort(decoded, peer)
        else:
            log.warning("unexpected %s from %s", type(decoded).__name__, peer.name)

    def _handle_request(self, request: PrefillRequest, peer: PeerHandle) -> None:
        def reject(reason: RejectReason, detail: str) -> None:
            log.info("rejected %s: %s %s", request.request_id, reason.name, detail)
            rejected = PrefillRejected(
                request.request_id, request.transfer_id, reason, truncate_detail(detail)
            )
            self._control.send(peer, rejected)

        if self._refusal is not None:
            return reject(*self._refusal)
        peer = self._decoder_peer(request, peer)
        if request.request_id in self._table.by_id:
            return reject(RejectReason.INTERNAL, "request id already in flight")
        if not self._context.has_free_row:
            return reject(RejectReason.OVERLOADED, f"{self.config.max_transfers} transfers live")
        try:
            checked = check_request(request, self.side, self._rng)
            checksums = check_checksums(
                checked,
                self.side,
                self.config.max_checksum_shards,
                self.config.fault_flip_after_checksum,
            )
        except RequestRejected as error:
            return reject(error.reason, str(error))
        try:
            lane = self._lanes.pick(checked, peer)
        except FabricError as error:  # a decoder NIC's address this engine cannot use
            return reject(RejectReason.INCOMPATIBLE, f"decoder NIC unusable: {error}")
        now = time.monotonic()
        out = Outgoing(
            checked,
            peer,
            lane,
            PrefillTransfer(request.request_id, request.transfer_id, None, now),
            now + request.timeout_ms / 1000,
            num_pages_for_tokens(len(request.token_ids), self.geometry.page_size)
            - request.skip_pages,
            self._context.take_row(),
        )
        out.checksums = checksums
        self._table.by_id[request.request_id] = out
        self._table.queued.append(out)

    def _decoder_peer(self, request: PrefillRequest, peer: PeerHandle) -> PeerHandle:
        """The sender's peer, re-resolved when its decoder incarnation is new at this address:
        its process was replaced, so the transfers into the old one stop (their descriptors name
        memory of a process that is gone) and nothing cached of it (a failed state) applies."""
        if not self._decoders.replaced(request, peer):
            return peer
        for out in list(self._table.by_id.values()):
            if out.peer.address == peer.address and out.active:
                self._stop(out, "decoder restarted: stale descriptors", failed=True)
        # Every NIC of it, as every NIC of this worker knows it.
        self._lanes.forget((peer.address, *request.nic_addresses))
        return self._decoders.resolve_afresh(peer.address)

    def _admit(self) -> None:
        table = self._table
        while table.queued:
            out = table.queued[0]
            if table.reserved_pages + out.num_engine_pages > self.engine.num_pages:
                return
            if out.request_id in table.engine_ending:
                return  # admitted after the engine's next step (`PrefillTable.engine_ending`)
            table.queued.popleft()
            tokens = list(out.request.token_ids)
            try:
                # The prefill role computes every prompt token but the last; the decoder kept
                # the real last token, so any valid id stands in for it.
                self.engine.add_request(
                    out.request.request_id,
                    [*tokens, tokens[-1]],
                    SamplingParams(temperature=0.0, max_tokens=1),
                )
            except EngineError as error:
                # `check_request` applies the engine's bounds, so this is not expected; but an
                # engine refusal fails this request, never the step loop (and the worker).
                log.warning("engine refused %s: %s", out.request_id, error)
                self._reject_admission(out, error)
                continue
            out.in_engine = True
            table.reserved_pages += out.num_engine_pages

    def _reject_admission(self, out: Outgoing, error: EngineError) -> None:
        """Answer a queued request the engine refused (`PrefillRejected`) and drop it: nothing
        was submitted for it, so the decoder frees its pages at once."""
        reason = (
            RejectReason.TOO_LONG
            if isinstance(error, InvalidRequestError | CapacityError)
            else RejectReason.INTERNAL
        )
        detail = truncate_detail(str(error))
        self._control.send(
            out.peer, PrefillRejected(out.request_id, out.transfer.imm, reason, detail)
        )
        self._stop(out, f"rejected: {error}", failed=True)

    def _handle_abort(self, abort: AbortPrefill, peer: PeerHandle) -> None:
        out = self._table.live(abort.request_id, abort.transfer_id)
        if out is None:
            # Ended (its count) or never seen here (0: e.g. the request was lost, or this
            # worker restarted at the same address): either way it submits nothing more.
            submitted = self._table.ended_writes(abort.request_id, abort.transfer_id)
            self._control.send(
                peer, AbortAcknowledged(abort.request_id, abort.transfer_id, submitted)
            )
            return
        if out.active:
            self._stop(out, "aborted by the decoder", failed=False)
        ack = AbortAcknowledged(
            abort.request_id, abort.transfer_id, out.transfer.num_writes_submitted
        )
        self._control.send(peer, ack)

    def _give_up(self, out: Outgoing, reason: FailReason, detail: str) -> None:
        """Stop an active transfer as failed and tell the decoder (`PrefillFailed`) at once.

        The count sent is final: `_stop` ends submitting under the lock the push thread and the
        context write take before they submit.
        """
        self._stop(out, detail, failed=True)
        submitted = out.transfer.num_writes_submitted
        failed = PrefillFailed(
            out.request_id, out.transfer.imm, reason, submitted, truncate_detail(detail)
        )
        self._control.send(out.peer, failed)

    # -- completion and freeing -------------------------------------------------------------

    def _handle_completion(self, request_id: str, count: int, error: FabricError | None) -> None:
        out = self._table.by_id.get(request_id)
        if out is None:
            log.error("completion of %d writes for unknown transfer %s", count, request_id)
            return
        with self._table.lock:
            if error is not None:
                log.warning("transfer %s: %d writes failed: %s", request_id, count, error)
            was_active = out.active
            out.transfer.record_completion(time.monotonic(), ok=error is None, count=count)
            stopped_now = was_active and not out.active
        if stopped_now:  # a lost write: the decoder's count can never be reached
            failed = PrefillFailed(
                request_id,
                out.transfer.imm,
                FailReason.WRITE_ERROR,
                out.transfer.num_writes_submitted,
                truncate_detail(f"{count} writes failed: {error}"),
            )
            self._control.send(out.peer, failed)
        self._finish_if_drained(out)

    def _handle_not_posted(self, request_id: str, imm: int, error: FabricError) -> None:
        """Writes of the transfer were never posted (already taken out of its count): its
        planned count can no longer be reached, so it is given up; stopped meanwhile, it may
        now have nothing left in flight."""
        out = self._table.live(request_id, imm)
        if out is None:
            return
        if out.active:
            self._give_up(out, FailReason.WRITE_ERROR, f"writes not posted: {error}")
        else:
            self._finish_if_drained(out)

    def _stop(self, out: Outgoing, reason: str, *, failed: bool) -> None:
        with self._table.lock:
            out.transfer.stop(reason, time.monotonic(), failed=failed)
        if out in self._table.queued:
            self._table.queued.remove(out)
        if out.transfer.is_terminal:
            self._free(out)

    def _finish_if_drained(self, out: Outgoing) -> None:
        with self._table.lock:
            if out.transfer.state is PrefillState.WRITING and not out.prefilled:
                return
            finished = out.transfer.finish_if_drained(time.monotonic())
        if finished:
            self._free(out)

    def _free(self, out: Outgoing) -> None:
        request_id = out.request.request_id
        table = self._table
        with table.lock:
            del table.by_id[request_id]
        self._context.give_back_row(out.context_row)
        # Remembered first: were the engine to fail below, a re-sent abort still gets the count.
        table.remember(out)
        if out.in_engine:
            table.reserved_pages -= out.num_engine_pages
            if self._engine_failed:
                pass  # never call a failed engine; its pages go with the process
            elif out.transfer.state is PrefillState.DONE:
                self.engine.release(request_id)
            elif self.engine.abort(request_id) and not out.prefilled:
                # Still among the engine's requests (a prefilled one is held and released
                # without an output): its final output comes from the next step.
                table.engine_ending.add(request_id)

    # -- state and teardown ---------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        by_state = self._table.count_by_state()
        return {
            "num_free_pages": self.engine.block_manager.num_free_pages,
            "num_pages": self.engine.num_pages,
            "num_transfers": sum(by_state.values()),
            "transfers_by_state": by_state,
            "num_queued": len(self._table.queued),
            "num_passes_pushed": self._push.num_passes,
            # Prompt tokens found in this worker's prefix cache (not computed; still sent).
            "num_prefix_cache_hits": self.engine.scheduler.num_prefix_cache_hits,
            "num_unauthenticated_messages": self.num_unauthenticated_messages,
        }

    def shutdown(self) -> None:
        """Step thread, first step of a graceful close: reject new requests (DRAINING) and
        give up every live transfer, each decoder told with `PrefillFailed(DRAINING)`."""
        self._refusal = (RejectReason.DRAINING, "worker is shutting down")
        for out in list(self._table.by_id.values()):
            if out.active:
                self._give_up(out, FailReason.DRAINING, "prefill worker draining (shutting down)")

    def engine_failed(self, detail: str) -> None:
        """The step loop died (called on its thread, as its last act): give up every live
        transfer now, each decoder told `PrefillFailed(ENGINE_ERROR)`, so it fails the request
        (and the router retries it on another prefill worker) at once instead of at its
        deadline; refuse every new request from now on. The engine is never called again (its
        state after a failed step is unknown); `poll` keeps answering messages and draining
        completions for whoever takes the messenger over (`PrefillWorker`)."""
        self._engine_failed = True
        self._refusal = (RejectReason.INTERNAL, truncate_detail(detail))
        for out in list(self._table.by_id.values()):
            if out.active:
                self._give_up(out, FailReason.ENGINE_ERROR, detail)
        # A pass the loop planned may never end now: end it (and any queued one) for the push
        # thread, whose gate refuses every layer of the transfers just given up.
        self._push.pass_ended(sys.maxsize)

    def set_wake(self, wake: Callable[[], None]) -> None:
        """Whom fabric callbacks wake from now on (the thread that polls the messenger)."""
        self._wake = wake

    @property
    def push_idle(self) -> bool:
        """The push thread has no pass to push (none planned, or every planned one ended)."""
        return self._push.idle

    def is_drained(self) -> bool:
        """No transfer left (every in-flight write completed) and every message sent."""
        return not self._table.by_id and self._control.in_flight == 0

    def close(self) -> None:
        self._refusal = (RejectReason.DRAINING, "worker is shutting down")
        self.fabric.on_message(None)
        self._push.close()
        self._hooks.remove()
