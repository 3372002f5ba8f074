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
- **PrefillAccepted** carries the exact write count and goes out when the request's last chunk
  is scheduled: only then are all its source page ids (and so the coalesced runs) known. The
  decoder's counter buffers writes that land before it is armed.
- Pages of each pass are sent as `workers.kv.pages.sendable_pages` allows (whole segments, or
  the rest after the last chunk), so the runs never depend on how the scheduler chunked.
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
  of the count first (`_not_posted`), then the transfer is given up: a count reported never
  names a write that cannot land.
- A message from a decoder the fabric marked failed proves it alive: the peer is resolved
  afresh (`_sender`), else every later answer and write to that decoder would fail.
  `shutdown` (the worker's graceful close) also rejects new requests (DRAINING); the worker
  then waits, bounded, until in-flight writes and these messages completed (`is_drained`).
- **Checksum mode** (the decoder's `PrefillRequest.checksum`, `workers.kv.checksum`): the push
  thread sums the bytes of every write it posts; the context write, which carries the sums
  after the hidden state, goes once both the forward pass ended and every layer is summed.

Threads: `poll`, the engine hooks and `after_step` run on the worker's step thread (the only
one touching the engine; once it died, `poll` runs on the thread that took the messenger over,
and the engine is not touched again); the push thread calls `_gate`; fabric callbacks only
enqueue. Transfer state is shared under one lock.
"""

from __future__ import annotations

import logging
import queue
import random
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from workers.engine.engine_core import EngineCore
from workers.engine.errors import CapacityError, EngineError, InvalidRequestError
from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import ScheduledChunk
from workers.fabric import FabricError, Message, PeerHandle, TransferEngine
from workers.kv.checksum import ChecksumAccumulator, area_bytes, byte_view, shard_order
from workers.kv.errors import KvTransferError, ProtocolError
from workers.kv.outgoing import Outgoing
from workers.kv.pages import num_pages_for_tokens
from workers.kv.pools import register_engine_pools
from workers.kv.prefill_checks import CheckedRequest, RequestRejected, check_request
from workers.kv.protocol import (
    AbortAcknowledged,
    AbortPrefill,
    FailReason,
    PrefillFailed,
    PrefillRejected,
    PrefillRequest,
    RejectReason,
    decode_message,
    encode_message,
    truncate_detail,
)
from workers.kv.push import CallOutcome, PassPlan, PushItem, PushThread
from workers.kv.sharding import GroupSharding
from workers.kv.transfer_state import PrefillState, PrefillTransfer

log = logging.getLogger(__name__)

_ACTIVE = (PrefillState.QUEUED, PrefillState.PREFILLING, PrefillState.WRITING)
# Sleep of the step thread after it queued a pass's last writes: long enough for the woken
# fabric progress thread to take the GIL and post them (`_on_forward_end`); once per pass.
_HAND_OFF_S = 0.0001


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


def _send_failed(peer_name: str, error: FabricError) -> None:
    log.info("control message to %s not delivered: %s", peer_name, error)


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
    ) -> None:
        """``rank_pools``: every TP rank's KV pool in rank order (default: the engine's own)."""
        self.engine = engine
        self.fabric = fabric
        self.config = config = config or PrefillMessengerConfig()
        model = engine.model_config
        self.sharding, self.geometry, self.pools = register_engine_pools(
            fabric, engine, rank_pools, sharding
        )
        # Rows of bytes: the hidden state, then (checksum mode) the checksum area; 8-aligned.
        self._hidden_bytes = model.hidden_size * torch.empty((), dtype=engine.dtype).element_size()
        row_bytes = self._hidden_bytes + area_bytes(config.max_checksum_shards)
        self._row_stride = -(-row_bytes // 8) * 8
        self._staging = torch.zeros(config.max_transfers, self._row_stride, dtype=torch.uint8)
        self._staging_handle, _ = fabric.register(self._staging)
        # The hidden-state part of each row in the engine's dtype: staging is one copy_ (with
        # the cast) at the pass end, on the path the exposed transfer time measures.
        self._staged_hidden = self._staging[:, : self._hidden_bytes].view(engine.dtype)
        try:  # checksum mode reads the source pools as bytes (host memory only)
            src_views = [byte_view(pool) for pool in rank_pools or [engine.kv_cache]]
        except KvTransferError:
            src_views = []
        self._checksum_capable = bool(src_views)
        self._free_rows: deque[int] = deque(range(config.max_transfers))
        self._rng = random.Random(config.seed)
        # This registration's id (`PrefillEndpoint.incarnation`): a restarted worker draws anew.
        self.incarnation = random.SystemRandom().getrandbits(64) or 1
        self.decoder_incarnations: dict[bytes, int] = {}  # decoder address -> its last one
        self._lock = threading.Lock()
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._events: queue.SimpleQueue[tuple[str, int, FabricError | None]] = queue.SimpleQueue()
        # (request id, imm, why) of writes the fabric refused at once (`_not_posted`).
        self._not_posted_events: queue.SimpleQueue[tuple[str, int, FabricError]] = (
            queue.SimpleQueue()
        )
        self._wake = wake or (lambda: None)
        self._by_id: dict[str, Outgoing] = {}
        self._queued: deque[Outgoing] = deque()
        self._reserved_pages = 0
        # Request ids aborted in the engine whose final ("abort") output is still to come (from
        # its next step). The engine knows requests by the decoder's id: a new request with
        # such an id waits in the queue until that output came, else it would be taken for the
        # new one's (`after_step`) and the new one would be given up yet kept in the engine.
        self._engine_ending: set[str] = set()
        self.finished: OrderedDict[str, dict[str, Any]] = OrderedDict()
        # Writes ever submitted by each ended transfer, by (request id, imm): re-sent aborts.
        self._ended_writes: OrderedDict[tuple[str, int], int] = OrderedDict()
        # (request, its row in the pass's hidden states) of each request whose last chunk runs
        # in the current pass: set before the pass, used at its end (`_on_forward_end`).
        self._pass_last: list[tuple[Outgoing, int]] = []
        # Why new requests are refused (None while serving): draining, or the engine failed.
        self._refusal: tuple[RejectReason, str] | None = None
        self._engine_failed = False
        self._sends_lock = threading.Lock()
        self._sends_in_flight = 0
        engine.on_step_scheduled = self.on_step_scheduled
        self._hook = engine.model.norm.register_forward_hook(self._on_forward_end)
        self._push = PushThread(
            fabric,
            self.pools.handles,
            engine.layer_progress,
            model.num_layers,
            self._gate,
            self._on_write_done,
            self._on_write_error,
            poll_interval_s=config.poll_interval_s,
            layerwise=config.layerwise,
            src_views=src_views,
            on_checksummed=self._on_checksummed,
            on_not_posted=self._on_not_posted,
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
        queues = (self._inbox, self._events, self._not_posted_events)
        return bool(self._by_id) or any(not pending.empty() for pending in queues)

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
                request_id, imm, error = self._not_posted_events.get_nowait()
            except queue.Empty:
                break
            self._handle_not_posted(request_id, imm, error)
        now = time.monotonic()
        for out in list(self._by_id.values()):
            if out.transfer.state in _ACTIVE and now >= out.deadline_s:
                log.warning("prefill transfer %s missed its deadline", out.request.request_id)
                self._give_up(out, FailReason.DEADLINE, "deadline passed on the prefill side")
        self._admit()

    def on_step_scheduled(self, chunks: list[ScheduledChunk]) -> None:
        """Engine hook, before the pass: plan the writes of every chunk's sendable pages."""
        pass_id = self.engine.layer_progress.read()[0] + 1
        items: list[PushItem] = []
        self._pass_last = []
        row = -1  # the chunk's last row in the pass's hidden states
        with self._lock:
            for chunk in chunks:
                row += chunk.num_tokens
                out = self._by_id.get(chunk.request_id)
                if out is None:
                    continue
                if chunk.end == len(out.request.token_ids):
                    self._pass_last.append((out, row))
                if out.transfer.state is PrefillState.QUEUED:
                    out.transfer.advance(PrefillState.PREFILLING, time.monotonic())
                out.src_pages.extend(chunk.page_ids)
                if out.transfer.accepts_writes:
                    item, accepted = out.plan_chunk(chunk, self.pools.layout)
                    if accepted is not None:
                        self._send(out.peer, accepted)
                    if item is not None:
                        items.append(item)
        self._push.submit_pass(PassPlan(pass_id, items))

    def _on_forward_end(self, module: object, args: object, hidden: torch.Tensor) -> None:
        """Forward hook of the model's final norm, the pass's last op the prefill role needs.

        Requests whose last chunk ran in this pass (`_pass_last`, found before the pass) enter
        WRITING, and their context (the hidden state of the last prefilled position) is staged
        and its write queued at once: it is what the decoder waits for, so nothing else runs
        before it (right after a pass this Python ran ~10x slower than in a warm loop, so every
        line before the post showed in the exposed time; bench/RESULTS.md).
        Then the pass's KV writes the push thread has not sent yet (all of them in the deferred
        baseline; `PushThread.pass_ended`). All on the step thread before the step returns,
        queued with one wake of the fabric's progress thread (`TransferEngine.wakes_deferred`:
        woken by the first, it would start moving bytes and, on CPU, starve this thread of the
        GIL and the cores before the rest is queued), then a short sleep that hands it the GIL,
        so it posts them now instead of after the rest of the step's Python.

        On CUDA the hook runs when the norm is launched, not when it ran: the stream is synced
        first, so that "the pass ended" (and the device's layer word read below, and the
        next pass's id in `on_step_scheduled`) means every layer's KV is in the pages.
        """
        if hidden.is_cuda:
            torch.cuda.current_stream(hidden.device).synchronize()
        now = time.monotonic()
        staged = False
        with self.fabric.wakes_deferred():  # the progress thread starts once all is queued
            for out, row in self._pass_last:
                with self._lock:
                    out.transfer.stats.forward_end_s = now
                    if out.transfer.state is not PrefillState.PREFILLING:
                        continue
                    out.transfer.advance(PrefillState.WRITING, now)
                    if out.checked.context is None:
                        continue
                    self._staged_hidden[out.context_row].copy_(hidden[row])
                    out.context_staged = True
                    # Checksum mode: posted once the push thread has every sum (there).
                    self._post_context_if_ready(out, now)
                    staged = True
            flushed = self._push.pass_ended(self.engine.layer_progress.read()[0])
        if flushed or staged:
            time.sleep(_HAND_OFF_S)

    def after_step(self, outputs: list[RequestOutput]) -> None:
        """After the step: requests the engine reports prefilled may be freed once drained."""
        for output in outputs:
            if output.finished and output.request_id in self._engine_ending:
                self._engine_ending.discard(output.request_id)
                continue  # an ended transfer's: a live one with this id is not in the engine
            out = self._by_id.get(output.request_id)
            if out is None:
                continue
            if output.finish_reason == "prefilled":
                out.prefilled = True
                self._finish_if_drained(out)
            elif output.finished and out.transfer.state in _ACTIVE:
                if out.in_engine:  # the engine already ended it: nothing to abort there
                    out.in_engine = False
                    self._reserved_pages -= out.num_pages_total
                detail = f"engine ended the request ({output.finish_reason})"
                self._give_up(out, FailReason.ENGINE_ERROR, detail)

    def _on_checksummed(self, item: PushItem) -> None:
        """Push thread: every layer of the request is summed; the context write may go."""
        with self._lock:
            out = self._by_id.get(item.request_id)
            if out is not None and out.transfer.imm == item.imm:
                self._post_context_if_ready(out, time.monotonic())

    def _post_context_if_ready(self, out: Outgoing, now: float) -> None:
        """Under the lock: post the context write once it is staged and (checksum mode) every
        checksum is in; the step thread and the push thread each call it when their half is
        done, and whichever comes second posts."""
        if out.context_sent or not out.context_staged or not out.transfer.accepts_writes:
            return
        if now >= out.deadline_s:
            return  # a prefill worker never submits after the deadline
        checksums = out.checksums
        if checksums is not None and not checksums.complete:
            return
        num_bytes = self._hidden_bytes
        if checksums is not None:
            staged = self._staging[out.context_row].numpy()
            area = checksums.area(staged[: self._hidden_bytes])
            staged[num_bytes : num_bytes + len(area)] = np.frombuffer(area, dtype=np.uint8)
            num_bytes += len(area)
        out.context_sent = True
        self._submit_context(out, num_bytes, now)

    def _submit_context(self, out: Outgoing, num_bytes: int, now: float) -> None:
        context = out.checked.context
        assert context is not None
        out.transfer.record_submit(num_bytes, now)
        request_id = out.request.request_id
        outcome = CallOutcome(
            1,
            partial(self._context_not_posted, out),
            lambda count, error: self._on_write_error(request_id, count, error),
        )
        try:
            self.fabric.submit_write(
                self._staging_handle,
                out.context_row * self._row_stride,
                out.peer,
                context,
                out.request.context_offset,
                num_bytes,
                imm=out.transfer.imm,
                on_done=lambda: self._on_write_done(request_id, 1),
                on_error=outcome.on_error,
                on_unposted=outcome.on_unposted,
            )
        except FabricError as error:  # refused before queueing: it never left
            self._not_posted(out, 1, num_bytes, error)

    # -- push thread ----------------------------------------------------------------------------

    def _gate(self, item: PushItem, layer: int) -> bool:
        with self._lock:
            out = self._by_id.get(item.request_id)
            if out is None or out.transfer.imm != item.imm or not out.transfer.accepts_writes:
                return False
            now = time.monotonic()
            if now >= out.deadline_s:
                return False  # a prefill worker never submits after the deadline
            try:
                out.transfer.record_submit(item.num_bytes, now, count=item.num_writes)
            except KvTransferError:
                log.exception("transfer %s: write plan exceeded", item.request_id)
                return False
            return True

    def _on_not_posted(
        self, item: PushItem, count: int, num_bytes: int, error: FabricError
    ) -> None:
        """Push thread (or the step thread in `PushThread.pass_ended`): gated writes the fabric
        refused at once."""
        with self._lock:
            out = self._by_id.get(item.request_id)
            # Still live: a transfer ends only with nothing in flight, these writes included.
            if out is not None and out.transfer.imm == item.imm:
                self._not_posted(out, count, num_bytes, error)

    def _context_not_posted(
        self, out: Outgoing, count: int, num_bytes: int, error: FabricError
    ) -> None:
        """Callback thread: the context write was accepted but never posted (`CallOutcome`)."""
        with self._lock:
            if self._by_id.get(out.request_id) is out:  # still live: it was in flight
                self._not_posted(out, count, num_bytes, error)

    def _not_posted(self, out: Outgoing, count: int, num_bytes: int, error: FabricError) -> None:
        """Under the lock: take writes recorded as submitted but never posted back out of the
        count at once, before any count is reported (an abort acknowledged meanwhile would
        otherwise name writes that never come, and the decoder's quarantine would wait for
        them forever); the step thread then gives the transfer up (`_handle_not_posted`)."""
        log.warning("transfer %s: %d writes not posted: %s", out.request_id, count, error)
        out.transfer.unrecord_submit(num_bytes, count)
        self._not_posted_events.put((out.request_id, out.transfer.imm, error))
        self._wake()

    # -- messages -------------------------------------------------------------------------------

    def _handle_message(self, message: Message) -> None:
        try:
            peer = self._sender(message.source)
        except FabricError as error:
            log.warning("message from an unreachable peer dropped: %s", error)
            return
        try:
            decoded = decode_message(message.payload)
        except ProtocolError as error:
            log.warning("malformed message from %s: %s", peer.name, error)
            return
        if isinstance(decoded, PrefillRequest):
            self._handle_request(decoded, peer)
        elif isinstance(decoded, AbortPrefill):
            self._handle_abort(decoded, peer)
        else:
            log.warning("unexpected %s from %s", type(decoded).__name__, peer.name)

    def _sender(self, address: bytes) -> PeerHandle:
        """The peer a message came from. The message proves its process alive and reachable
        now, so a failed state the fabric keeps for it (an operation that missed its deadline
        while the decoder was stopped or slow: never cleared by the fabric) no longer applies;
        kept, every answer to it and every write for it would fail at once, forever. As the
        decoder does for a prefill peer found alive (`DecodeMessenger._probed`)."""
        failure = self.fabric.peer_failure(address)
        if failure is not None:
            log.info("message from a peer marked failed (%s): resolving it afresh", failure)
            self.fabric.forget_peer(address)
        return self.fabric.add_peer(address)

    def _handle_request(self, request: PrefillRequest, peer: PeerHandle) -> None:
        def reject(reason: RejectReason, detail: str) -> None:
            log.info("rejected %s: %s %s", request.request_id, reason.name, detail)
            rejected = PrefillRejected(
                request.request_id, request.transfer_id, reason, truncate_detail(detail)
            )
            self._send(peer, rejected)

        if self._refusal is not None:
            return reject(*self._refusal)
        peer = self._decoder_peer(request, peer)
        if request.request_id in self._by_id:
            return reject(RejectReason.INTERNAL, "request id already in flight")
        if not self._free_rows:
            return reject(RejectReason.OVERLOADED, f"{self.config.max_transfers} transfers live")
        try:
            checked = check_request(request, self, self._rng)
            checksums = self._checksums_for(checked)
        except RequestRejected as error:
            return reject(error.reason, str(error))
        now = time.monotonic()
        out = Outgoing(
            checked,
            peer,
            PrefillTransfer(request.request_id, request.transfer_id, None, now),
            now + request.timeout_ms / 1000,
            num_pages_for_tokens(len(request.token_ids), self.geometry.page_size),
            self._free_rows.popleft(),
        )
        out.checksums = checksums
        self._by_id[request.request_id] = out
        self._queued.append(out)

    def _decoder_peer(self, request: PrefillRequest, peer: PeerHandle) -> PeerHandle:
        """The sender's peer, re-resolved when its decoder incarnation is new at this address:
        its process was replaced, so the transfers into the old one stop (their descriptors name
        memory of a process that is gone) and nothing cached of it (a failed state) applies."""
        new = request.decode_incarnation
        old = self.decoder_incarnations.get(peer.address)
        if new:
            self.decoder_incarnations[peer.address] = new
        if not new or old is None or old == new:
            return peer
        for out in list(self._by_id.values()):
            if out.peer.address == peer.address and out.transfer.state in _ACTIVE:
                self._stop(out, "decoder restarted: stale descriptors", failed=True)
        self.fabric.forget_peer(peer.address)
        return self.fabric.add_peer(peer.address)

    def _checksums_for(self, checked: CheckedRequest) -> ChecksumAccumulator | None:
        """Checksum mode's accumulator for an accepted request, None when it did not ask."""
        request = checked.request
        if not request.checksum:
            return None
        incompatible = RejectReason.INCOMPATIBLE
        if not self._checksum_capable:
            raise RequestRejected(incompatible, "checksum mode needs host-memory KV pools")
        num_shards = len(checked.plan.shards)
        if num_shards > self.config.max_checksum_shards:
            raise RequestRejected(
                incompatible, f"checksums of {num_shards} shards exceed the staging row"
            )
        try:
            shard_order(checked.plan)
        except KvTransferError as error:
            raise RequestRejected(incompatible, str(error)) from error
        context = checked.context
        needed = self._hidden_bytes + area_bytes(num_shards)
        if context is None or request.context_offset + needed > context.length:
            raise RequestRejected(incompatible, "context buffer too small for the checksums")
        checksums = ChecksumAccumulator(
            self.geometry.num_layers,
            num_shards,
            num_pages_for_tokens(len(request.token_ids), self.geometry.page_size),
        )
        checksums.flip_pending = request.request_id in self.config.fault_flip_after_checksum
        return checksums

    def _admit(self) -> None:
        while self._queued:
            out = self._queued[0]
            if self._reserved_pages + out.num_pages_total > self.engine.num_pages:
                return
            if out.request_id in self._engine_ending:
                return  # admitted after the engine's next step (`_engine_ending`)
            self._queued.popleft()
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
            self._reserved_pages += out.num_pages_total

    def _reject_admission(self, out: Outgoing, error: EngineError) -> None:
        """Answer a queued request the engine refused (`PrefillRejected`) and drop it: nothing
        was submitted for it, so the decoder frees its pages at once."""
        reason = (
            RejectReason.TOO_LONG
            if isinstance(error, InvalidRequestError | CapacityError)
            else RejectReason.INTERNAL
        )
        detail = truncate_detail(str(error))
        self._send(out.peer, PrefillRejected(out.request_id, out.transfer.imm, reason, detail))
        self._stop(out, f"rejected: {error}", failed=True)

    def _handle_abort(self, abort: AbortPrefill, peer: PeerHandle) -> None:
        out = self._by_id.get(abort.request_id)
        if out is None or out.transfer.imm != abort.transfer_id:
            # Ended (its count) or never seen here (0: e.g. the request was lost, or this
            # worker restarted at the same address): either way it submits nothing more.
            submitted = self._ended_writes.get((abort.request_id, abort.transfer_id), 0)
            self._send(peer, AbortAcknowledged(abort.request_id, abort.transfer_id, submitted))
            return
        if out.transfer.state in _ACTIVE:
            self._stop(out, "aborted by the decoder", failed=False)
        ack = AbortAcknowledged(
            abort.request_id, abort.transfer_id, out.transfer.num_writes_submitted
        )
        self._send(peer, ack)

    def _send(self, peer: PeerHandle, message: Any) -> None:
        with self._sends_lock:
            self._sends_in_flight += 1
        try:
            self.fabric.submit_send(
                peer,
                encode_message(message),
                on_done=self._on_send_done,
                on_error=partial(self._on_send_error, peer.name),
            )
        except FabricError as error:
            self._on_send_done()
            log.warning("could not send %s to %s: %s", type(message).__name__, peer.name, error)

    def _on_send_done(self) -> None:  # fabric callback thread
        with self._sends_lock:
            self._sends_in_flight -= 1

    def _on_send_error(self, peer_name: str, error: FabricError) -> None:  # fabric callback
        self._on_send_done()
        _send_failed(peer_name, error)

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
        self._send(out.peer, failed)

    # -- completion and freeing -------------------------------------------------------------

    def _handle_completion(self, request_id: str, count: int, error: FabricError | None) -> None:
        out = self._by_id.get(request_id)
        if out is None:
            log.error("completion of %d writes for unknown transfer %s", count, request_id)
            return
        with self._lock:
            if error is not None:
                log.warning("transfer %s: %d writes failed: %s", request_id, count, error)
            was_active = out.transfer.state in _ACTIVE
            out.transfer.record_completion(time.monotonic(), ok=error is None, count=count)
            stopped_now = was_active and out.transfer.state not in _ACTIVE
        if stopped_now:  # a lost write: the decoder's count can never be reached
            failed = PrefillFailed(
                request_id,
                out.transfer.imm,
                FailReason.WRITE_ERROR,
                out.transfer.num_writes_submitted,
                truncate_detail(f"{count} writes failed: {error}"),
            )
            self._send(out.peer, failed)
        self._finish_if_drained(out)

    def _handle_not_posted(self, request_id: str, imm: int, error: FabricError) -> None:
        """Writes of the transfer were never posted (already taken out of its count): its
        planned count can no longer be reached, so it is given up; stopped meanwhile, it may
        now have nothing left in flight."""
        out = self._by_id.get(request_id)
        if out is None or out.transfer.imm != imm:
            return
        if out.transfer.state in _ACTIVE:
            self._give_up(out, FailReason.WRITE_ERROR, f"writes not posted: {error}")
        else:
            self._finish_if_drained(out)

    def _stop(self, out: Outgoing, reason: str, *, failed: bool) -> None:
        with self._lock:
            out.transfer.stop(reason, time.monotonic(), failed=failed)
        if out in self._queued:
            self._queued.remove(out)
        if out.transfer.is_terminal:
            self._free(out)

    def _finish_if_drained(self, out: Outgoing) -> None:
        with self._lock:
            if out.transfer.state is PrefillState.WRITING and not out.prefilled:
                return
            finished = out.transfer.finish_if_drained(time.monotonic())
        if finished:
            self._free(out)

    def _free(self, out: Outgoing) -> None:
        request_id = out.request.request_id
        with self._lock:
            del self._by_id[request_id]
        self._free_rows.append(out.context_row)
        # Remembered first: were the engine to fail below, a re-sent abort still gets the count.
        self._remember(out)
        if out.in_engine:
            self._reserved_pages -= out.num_pages_total
            if self._engine_failed:
                pass  # never call a failed engine; its pages go with the process
            elif out.transfer.state is PrefillState.DONE:
                self.engine.release(request_id)
            elif self.engine.abort(request_id) and not out.prefilled:
                # Still among the engine's requests (a prefilled one is held and released
                # without an output): its final output comes from the next step.
                self._engine_ending.add(request_id)

    def _remember(self, out: Outgoing) -> None:
        self.finished[out.request_id] = out.summary()
        while len(self.finished) > self.config.finished_memory:
            self.finished.popitem(last=False)
        key = (out.request_id, out.transfer.imm)
        self._ended_writes[key] = out.transfer.num_writes_submitted
        while len(self._ended_writes) > self.config.finished_memory:
            self._ended_writes.popitem(last=False)

    # -- state and teardown ---------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        with self._lock:
            by_state: dict[str, int] = {}
            for out in self._by_id.values():
                by_state[out.transfer.state.value] = by_state.get(out.transfer.state.value, 0) + 1
        return {
            "num_free_pages": self.engine.block_manager.num_free_pages,
            "num_pages": self.engine.num_pages,
            "num_transfers": sum(by_state.values()),
            "transfers_by_state": by_state,
            "num_queued": len(self._queued),
            "num_passes_pushed": self._push.num_passes,
        }

    def shutdown(self) -> None:
        """Step thread, first step of a graceful close: reject new requests (DRAINING) and
        give up every live transfer, each decoder told with `PrefillFailed(DRAINING)`."""
        self._refusal = (RejectReason.DRAINING, "worker is shutting down")
        for out in list(self._by_id.values()):
            if out.transfer.state in _ACTIVE:
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
        for out in list(self._by_id.values()):
            if out.transfer.state in _ACTIVE:
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
        with self._sends_lock:
            sends = self._sends_in_flight
        return not self._by_id and sends == 0

    def close(self) -> None:
        self._refusal = (RejectReason.DRAINING, "worker is shutting down")
        self.fabric.on_message(None)
        self._push.close()
        self._hook.remove()
        self.engine.on_step_scheduled = None
