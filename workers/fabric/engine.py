"""`TransferEngine`: one libfabric RDM endpoint, its progress thread and its callback thread.

Threads. The progress thread polls the completion queue (targets must poll for writes to land
on manual-progress providers such as `tcp`), posts queued submissions and checks deadlines.
User callbacks (`on_done`, `on_error`, `on_reached`, message handlers) never run there: they run
one at a time, in event order, on the engine's callback thread, so a slow callback cannot stall
transfers. Callbacks may call the engine (submit, expect, ...); they should still be short.

Back-pressure. `submit_*` validates in the caller, then queues one entry per call. When
`max_queued_submits` calls are queued (not yet fully posted), the caller blocks until there is
room, at most `submit_timeout` seconds, then gets `SubmitQueueFullError` (`submit_timeout=0`
raises at once). Submitting never spins.

Failures. Every operation has a deadline (`op_timeout`); a connection error completion or a
missed deadline marks the peer failed: its unfinished operations end in `on_error`
(`PeerFailedError` / `OperationTimeoutError`) and later submissions to it raise
`PeerFailedError`. Other peers are unaffected; `peer_failure` tells why a peer failed.

Regions. `register` takes host memory and, on an engine opened with ``hmem=True`` (FI_HMEM
and FI_MR_HMEM; a provider without it fails at open with `FabricUnavailableError`, tcp has
none), CUDA tensors. shm registrations move host regions to huge pages first. Both, and when a
deregistered region's registration closes: `workers.fabric.registration`.

The engine is the public surface over modules of one job each: the native endpoint
(`endpoint`), registrations (`registration`), peers by address (`addresses`), the checks and
native layout of writes (`write_checks`), and the progress thread (`progress`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from workers.fabric import paging
from workers.fabric._lib import lib
from workers.fabric.addresses import PeerDirectory
from workers.fabric.callbacks import CallbackDispatcher, Inline
from workers.fabric.closing import EngineClosing
from workers.fabric.completions import NAP_WAIT_US
from workers.fabric.counters import ImmCounters, ImmStats
from workers.fabric.descriptors import MemoryRegionDescriptor
from workers.fabric.endpoint import close_endpoint, endpoint_name, open_endpoint
from workers.fabric.errors import EngineClosedError, FabricError
from workers.fabric.handles import MemoryRegionHandle, PeerHandle
from workers.fabric.jobs import ErrorCallback, ProgressStats, UnpostedCallback
from workers.fabric.messages import MIN_FREE_OP_SLOTS, Message, MessagePools, check_slots
from workers.fabric.progress import ProgressLoop
from workers.fabric.providers import normalize_provider
from workers.fabric.registration import Registrations
from workers.fabric.submission import Submitter
from workers.fabric.watchdog import MAX_POLL_US, check_poll_waits
from workers.fabric.write_checks import PreparedWrites, paged_rows

if TYPE_CHECKING:
    from workers.fabric._fabric_cffi import PdEngine

log = logging.getLogger(__name__)

# The construction limits stay importable from here, next to the engine they bound.
__all__ = ["MAX_POLL_US", "MIN_FREE_OP_SLOTS", "EngineStats", "PreparedWrites", "TransferEngine"]
_engine_ids = itertools.count(1)


@dataclass(frozen=True)
class EngineStats:
    progress: ProgressStats
    imm: ImmStats
    callback_errors: int


class TransferEngine:
    """One-sided writes with immediate data, immediate counters and small messages."""

    def __init__(
        self,
        provider: str = "tcp;ofi_rxm",
        node: str | None = "127.0.0.1",
        *,
        domain: str | None = None,
        op_timeout: float = 30.0,
        submit_timeout: float = 10.0,
        max_queued_submits: int = 4096,
        max_inflight_ops: int = 4096,
        max_message_bytes: int = 64 * 1024,
        num_receive_buffers: int = 64,
        num_send_buffers: int = 64,
        spin_us: int = 50,
        idle_spin_us: int = 2000,
        idle_wait_us: int | None = None,
        huge_pages: bool | None = None,
        hmem: bool = False,
        counters: ImmCounters | None = None,
    ) -> None:
        """``counters``: immediate counters shared with other engines of this rank (one per
        NIC, `workers.fabric.nics`), so a value counts the writes landing on any of them;
        None: its own."""
        check_slots(max_inflight_ops, num_receive_buffers)
        check_poll_waits(spin_us, idle_wait_us)
        self._id = next(_engine_ids)
        self._closed = False  # refuses new work; set first by `close`
        self._native: PdEngine | None = None  # None once freed
        self.max_message_bytes = max_message_bytes
        provider = normalize_provider(provider)
        # None: on where the peer's kernel reads our pages one by one (`registration`).
        huge_pages = provider == "shm" if huge_pages is None else huge_pages
        # shm ignores node names; tcp needs one to bind to loopback (FI_SOURCE).
        node_arg = None if provider == "shm" else node
        self.info, native = open_endpoint(provider, node_arg, domain, max_inflight_ops, hmem)
        self._native = native
        self._registry = Registrations(native, self._id, self.info, huge_pages)
        registry = self._registry
        try:
            self.address = endpoint_name(native)
            self._pools = MessagePools(max_message_bytes, num_send_buffers, num_receive_buffers)
            self._pools.register(
                lambda array: registry.register_native(registry.extent(array)).desc
            )
            self.counters = ImmCounters() if counters is None else counters
            self._dispatcher = CallbackDispatcher(f"fabric-callbacks-{self._id}")
            if idle_wait_us is None:
                # With a CQ fd the idle thread wakes on traffic; without one it must poll.
                idle_wait_us = 20_000 if lib.pd_engine_wait_fd(native) >= 0 else NAP_WAIT_US
            self._loop = ProgressLoop(
                native,
                name=f"fabric-progress-{self._id}",
                counters=self.counters,
                dispatcher=self._dispatcher,
                pools=self._pools,
                max_queued_submits=max_queued_submits,
                spin_us=spin_us,
                idle_spin_us=idle_spin_us,
                idle_wait_us=idle_wait_us,
                provider_name=self.info.provider,
                regions=registry.regions,
                on_ended=lambda: self._closing.loop_ended(),
            )
            self._closing = EngineClosing(self._loop, self._dispatcher, self._release_native)
            self._peers = PeerDirectory(native, self.address, self.info.provider, self._loop)
            self._submit = Submitter(
                loop=self._loop,
                registry=registry,
                peers=self._peers,
                dispatcher=self._dispatcher,
                info=self.info,
                address=self.address,
                max_message_bytes=max_message_bytes,
                is_closed=lambda: self._closed,
                op_timeout=op_timeout,
                submit_timeout=submit_timeout,
            )
            self._loop.start()  # posts the receive buffers first: a refusal raises here
        except BaseException:
            dispatcher = getattr(self, "_dispatcher", None)
            if dispatcher is not None:
                dispatcher.close()
            self._release_native()
            raise
        log.debug("opened %s engine %s on %s", self.provider, self._id, self.info.domain)

    # -- properties ---------------------------------------------------------------------------

    @property
    def provider(self) -> str:
        return self.info.provider

    @property
    def hmem(self) -> bool:
        """Opened with FI_HMEM: `register` takes CUDA tensors too."""
        return self.info.hmem

    @property
    def imm_bits(self) -> int:
        """Width of immediate data here: 8 * fi_info cq_data_size, at most 64."""
        return self.info.imm_bits

    @property
    def max_write_bytes(self) -> int:
        return self.info.max_msg_size

    @property
    def op_timeout(self) -> float:
        """Seconds each operation may take before it fails (set: for later submissions)."""
        return self._submit.op_timeout

    @op_timeout.setter
    def op_timeout(self, seconds: float) -> None:
        self._submit.op_timeout = seconds

    @property
    def submit_timeout(self) -> float:
        """Seconds a submission waits for room in a full queue (module docstring)."""
        return self._submit.submit_timeout

    @submit_timeout.setter
    def submit_timeout(self, seconds: float) -> None:
        self._submit.submit_timeout = seconds

    @property
    def threads(self) -> tuple[threading.Thread, threading.Thread]:
        return self._loop.thread, self._dispatcher.thread

    def max_pages_per_run(self, page_bytes: int) -> int | None:
        """The split the engine applies to long runs (None: never split on this provider)."""
        limit = self.max_write_bytes // page_bytes
        return None if limit >= 1 << 40 else max(1, limit)

    # -- memory and peers -----------------------------------------------------------------------

    def register(self, buffer: object) -> tuple[MemoryRegionHandle, MemoryRegionDescriptor]:
        """Register host memory (torch CPU tensor, numpy array, bytearray, memoryview) or, on
        an engine opened with ``hmem=True``, a CUDA tensor (`BufferExtent.cuda_device`).

        Returns the local handle (source of writes) and the descriptor to give peers (target of
        their writes). The engine keeps `buffer` alive until `deregister` (and the last write
        from it) or `close`.
        With `huge_pages`, a host region's 2 MiB-aligned interior is moved to huge pages first
        (`workers.fabric.registration`; a copy of it, on this thread, before the provider
        sees the region).
        """
        self._check_open()
        # Typed errors (and the huge-page copy) on this thread, before the provider.
        extent = self._registry.prepare(buffer)
        handle: MemoryRegionHandle = self._loop.call(lambda: self._registry.register_native(extent))
        return handle, self._registry.descriptor(handle)

    def deregister(self, handle: MemoryRegionHandle) -> None:
        """Release a region. New writes from it are refused at once; writes from it still
        queued or posted go on, and its registration is closed when the last of them has
        ended (at once when none is; a peer's writes into it are the caller's to stop first).
        Writes posted to a failed peer may never end: then it stays registered until `close`.
        """
        self._check_open()
        # Removed from the registrations on the progress thread: if this raises (engine closed
        # meanwhile), the region is still there and `close` releases it.
        self._loop.call(lambda: self._loop.regions.deregister(handle))

    def add_peer(self, address: bytes) -> PeerHandle:
        """Insert a peer's `address` (its `engine.address`); idempotent per address, also
        when threads race (one handle per address)."""
        self._check_open()
        return self._peers.add(address)

    def forget_peer(self, address: bytes) -> None:
        """Forget what is cached of ``address`` (its failed state): its process was replaced
        by a new one at the same address. The next `add_peer` resolves it afresh.

        The handle is refused from now on; its address-vector entry is removed as soon as no
        call addressed to it is queued or has ops posted (at once, usually). Ops posted to a
        dead shm peer never complete, so such an entry stays until the engine closes."""
        self._check_open()
        self._peers.forget(address)

    def peer_failure(self, address: bytes) -> FabricError | None:
        """Why the peer at ``address`` failed (None: it has not): `PeerFailedError` for a
        dropped connection or an exited process, `OperationTimeoutError` when an operation only
        missed its deadline (the peer may still be alive, e.g. stopped or slow), its subclass
        `PeerStuckError` when a post to it never returned and the engine was abandoned."""
        return self._peers.failure(address)

    def closed_reason(self) -> str | None:
        """Why the engine takes no more work (closed, abandoned by its watchdog, or its progress
        thread died; with shared counters, also another engine of the rank ending, which closes
        them: its writes could never be counted); None while it works. Registered memory stays
        writable by peers until `close`: an abandoned engine cannot deregister it."""
        if self._closed:
            return "engine is closed"
        reason = self._loop.closed_reason()
        if reason is None and (lost := self.counters.closed_reason()) is not None:
            reason = f"immediate counters closed: {lost}"
        return reason

    # -- one-sided writes -----------------------------------------------------------------------

    def submit_write(
        self,
        src: MemoryRegionHandle,
        src_offset: int,
        peer: PeerHandle,
        dst: MemoryRegionDescriptor,
        dst_offset: int,
        length: int,
        imm: int | None = None,
        on_done: Callable[[], None] | None = None,
        on_error: ErrorCallback | None = None,
        on_unposted: UnpostedCallback | None = None,
    ) -> None:
        """Write `length` bytes; `on_done` means the bytes left (not landed) on `tcp`.
        ``on_unposted``: see `submit_writes`."""
        self._submit.write(
            src, src_offset, peer, dst, dst_offset, length, imm, on_done, on_error, on_unposted
        )

    def submit_paged_writes(
        self,
        src: MemoryRegionHandle,
        src_pages: paging.PageList,
        peer: PeerHandle,
        dst: MemoryRegionDescriptor,
        dst_pages: paging.PageList,
        page_bytes: int,
        src_stride: int | None = None,
        dst_stride: int | None = None,
        src_offset: int = 0,
        dst_offset: int = 0,
        imm: int | None = None,
        on_done: Callable[[], None] | None = None,
        on_error: ErrorCallback | None = None,
    ) -> int:
        """Write page `src_pages[i]` to page `dst_pages[i]`; returns the number of writes.

        Byte offset of page p: `offset + p * stride` (stride defaults to `page_bytes`), and
        `page_bytes` bytes move per page. One write per run (see `paging`); each carries `imm`.
        The decoder expects `count_paged_write_runs(src_pages, dst_pages,
        coalesce=can_coalesce(page_bytes, src_stride, dst_stride),
        max_pages_per_run=engine.max_pages_per_run(page_bytes))` completions.
        """
        ops = paged_rows(
            src_pages,
            dst_pages,
            page_bytes,
            src_stride=src_stride,
            dst_stride=dst_stride,
            src_offset=src_offset,
            dst_offset=dst_offset,
            max_pages_per_run=self.max_pages_per_run(page_bytes),
        )
        return self.submit_writes(src, peer, dst, ops, imm, on_done, on_error)

    def submit_writes(
        self,
        src: MemoryRegionHandle,
        peer: PeerHandle,
        dst: MemoryRegionDescriptor,
        ops: np.ndarray,
        imm: int | None = None,
        on_done: Callable[[], None] | None = None,
        on_error: ErrorCallback | None = None,
        on_unposted: UnpostedCallback | None = None,
    ) -> int:
        """Post exactly the given writes, one per row ``(src_offset, dst_offset, length)``.

        For callers that plan their writes themselves (the KV messenger posts the writes of
        `workers.kv.writes.plan_layer_writes`, so what it counts is what it posts). All rows are
        range-checked before anything is posted; `on_done` fires once after every write of the
        call completed locally. Returns the number of writes.

        If the call fails, ``on_unposted(count, num_bytes, error)`` runs first (on the callback
        thread, right before ``on_error``) when some of its writes were never posted: they
        waited in the queue when their peer failed, their deadline passed or the engine closed,
        so they can never land. A caller that counts writes the target will see (the KV
        messenger) takes them back out. Not called when the number cannot be known (the
        watchdog abandoned a progress thread stuck in the provider).
        """
        return self._submit.rows(src, peer, dst, ops, imm, on_done, on_error, on_unposted)

    def prepare_writes(
        self,
        src: MemoryRegionHandle,
        peer: PeerHandle,
        dst: MemoryRegionDescriptor,
        ops: np.ndarray,
    ) -> PreparedWrites:
        """Check and lay out writes now, post them later (`submit_prepared`, in row ranges).

        Rows as for `submit_writes` (at least one). Everything that depends only on the rows
        (range checks, native address arrays) is done here, so a caller that knows its writes
        ahead of the moment they may go (the KV messenger, before the forward pass) leaves that
        moment only the queueing. Raises as `submit_writes` would.
        """
        return self._submit.prepare(src, peer, dst, ops)

    def submit_prepared(
        self,
        prepared: PreparedWrites,
        start: int,
        stop: int,
        imm: int | None = None,
        on_done: Callable[[], None] | None = None,
        on_error: ErrorCallback | None = None,
        on_unposted: UnpostedCallback | None = None,
    ) -> None:
        """Queue rows ``[start, stop)`` of ``prepared`` (checked when prepared); `on_done` fires
        once after all of them completed locally (``on_unposted``: see `submit_writes`). Only the
        engine, region, peer and ``imm`` are checked again (the region may have been
        deregistered or the peer failed since)."""
        self._submit.prepared(prepared, start, stop, imm, on_done, on_error, on_unposted)

    def wakes_deferred(self) -> contextlib.AbstractContextManager[None]:
        """Submissions this thread makes inside the ``with`` block wake the progress thread
        once, when the block ends (nested blocks: the outermost). Queue a group of writes this
        way when the first should not start before the last is queued: a sleeping progress
        thread woken by the first takes the GIL and starts moving its bytes, and on a CPU host
        that can starve the submitting thread of the GIL and the cores for as long."""
        return self._loop.wakes_deferred()

    # -- immediate counters ---------------------------------------------------------------------

    def expect_imm(
        self,
        imm: int,
        count: int,
        on_reached: Callable[[], None],
        on_error: ErrorCallback | None = None,
        timeout: float | None = None,
        inline: bool = False,
    ) -> None:
        """Call `on_reached()` once when `count` writes carrying `imm` have landed here.

        Writes that landed before this call count. See `workers.fabric.counters` for the exact
        semantics (surplus, cancel tombstones, timeouts). ``inline``: `on_reached` runs where
        the count completes (the progress thread, or here), not on the callback thread; only
        for a callback that hands the event on without blocking (`callbacks.Inline`).
        """
        reason = self.closed_reason()  # closed, abandoned, or its progress thread died
        if reason is not None:
            raise EngineClosedError(reason)
        self._check_imm(imm)
        deadline = None if timeout is None else time.monotonic() + timeout
        reached = Inline(on_reached) if inline else on_reached
        self._dispatcher.submit_all(self.counters.expect(imm, count, reached, on_error, deadline))

    def imm_arrivals(self, imm: int) -> int:
        """Writes carrying `imm` that landed here since it was last armed (see counters)."""
        self._check_imm(imm)
        return self.counters.arrived(imm)

    def cancel_imm(self, imm: int) -> bool:
        """Disarm `imm`; its late writes are ignored (stats().imm.late_dropped) until re-armed."""
        self._check_imm(imm)
        return self.counters.cancel(imm)

    def take_imm_arrivals(self, imm: int) -> int:
        """Writes carrying the disarmed `imm` that landed here and were not taken yet; they are
        taken now, and `imm` stays tombstoned (see counters: the caller keeps the total)."""
        self._check_imm(imm)
        return self.counters.take_arrivals(imm)

    def reset_imm(self, imm: int) -> None:
        """Forget the disarmed `imm`'s tombstone and buffered writes: it is handed out anew, and
        no write of its earlier use can land any more (the caller's guarantee)."""
        self._check_imm(imm)
        self.counters.reset(imm)

    # -- messages -------------------------------------------------------------------------------

    def submit_send(
        self,
        peer: PeerHandle,
        payload: bytes,
        on_done: Callable[[], None] | None = None,
        on_error: ErrorCallback | None = None,
    ) -> None:
        """Send a small message; messages to one peer arrive in submission order."""
        self._submit.send(peer, payload, on_done, on_error)

    def on_message(self, handler: Callable[[Message], None] | None) -> None:
        """Deliver later messages to `handler` (callback thread) instead of `recv()`."""
        self._pools.handler = handler

    def recv(self, timeout: float | None = None) -> Message:
        """Next message not taken by a handler; raises `queue.Empty` after `timeout`."""
        return self._pools.inbox.get(timeout=timeout)

    # -- checks ---------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("engine is closed")

    def _check_imm(self, imm: int | None) -> None:
        self._submit.check_imm(imm)

    # -- teardown -------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return EngineStats(self._loop.stats, self.counters.stats(), self._dispatcher.errors)

    def close(self, timeout: float = 10.0) -> None:
        """Fail what is outstanding (`EngineClosedError`), stop both threads, free every fid.

        Idempotent. From inside a callback the callback thread is stopped without waiting.
        Where it cannot wait for the progress thread (called on it, from an inline callback,
        or the thread is still in a provider call after ``timeout``), that thread completes
        the teardown as it ends; a later `close` waits for it again (`closing`).
        """
        self._closed = True
        self._closing.close(timeout)

    def _release_native(self) -> None:
        """Free every region, then the endpoint (once the loop's work ended, or when the
        constructor fails)."""
        loop: ProgressLoop | None = getattr(self, "_loop", None)
        deferred = [] if loop is None else loop.regions.take_closing()
        if loop is not None:
            loop.detach_native()  # a late wake must not reach the freed engine
        self._registry.close_all(deferred)
        if self._native is not None:
            native, self._native = self._native, None
            close_endpoint(native, self.provider)

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
