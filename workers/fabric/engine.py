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

Huge pages (shm). libfabric 1.17's shm moves every write above its inject size by CMA: the
target's progress thread calls process_vm_readv on the initiator's memory, and the kernel pins
and copies the source one page at a time. From 4 KiB pages that copy runs at ~0.75x the rate it
reaches from 2 MiB transparent huge pages (bench/RESULTS.md, "Transfer: the shm gap"). numpy
asks for huge pages for its large arrays; torch's CPU allocator does not, so a KV pool in a
torch tensor was the slow case. `register` therefore backs the 2 MiB-aligned interior of a host
region with huge pages (`huge_pages`, default on for shm): MADV_HUGEPAGE, then MADV_COLLAPSE
(Linux >= 6.1) to convert the pages already faulted in, contents kept. Nothing is done when the
system disabled THP ("never"); a kernel or mapping that refuses only loses the speed-up.
tcp leaves pages alone by default (`huge_pages=True` turns it on): its sockets copy the bytes
anyway, and seven transfer-bench runs showed no clear gain (bench/RESULTS.md, "tcp regions on
huge pages").

Device memory. `TransferEngine(..., hmem=True)` asks the provider for FI_HMEM (and FI_MR_HMEM),
so `register` also takes CUDA tensors: the region is registered with ``FI_HMEM_CUDA`` and its
device, and the NIC reads and writes GPU pages directly (GPUDirect RDMA on verbs / efa; CUDA IPC
on a libfabric shm built with CUDA). A provider without it fails at open with
`FabricUnavailableError`; a CUDA tensor given to an engine opened without it fails in
`register` with `RegistrationError`, before the provider sees it. tcp has no FI_HMEM.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from workers.fabric import paging
from workers.fabric._lib import ffi, lib, strerror
from workers.fabric.callbacks import CallbackDispatcher, Inline
from workers.fabric.counters import ImmCounters, ImmStats
from workers.fabric.descriptors import MemoryRegionDescriptor
from workers.fabric.errors import (
    AddressError,
    DescriptorError,
    EngineClosedError,
    FabricError,
    FabricUnavailableError,
    ImmError,
    MessageTooLargeError,
    OutOfRangeError,
    ProviderError,
    RegistrationError,
)
from workers.fabric.handles import BufferExtent, MemoryRegionHandle, PeerHandle, buffer_extent
from workers.fabric.jobs import SEND, WRITE, Job, ProgressStats, UnpostedCallback
from workers.fabric.messages import MAX_ADDRESS_BYTES, Message, MessagePools
from workers.fabric.progress import ProgressLoop
from workers.fabric.providers import FabricInfo, describe, fi_info_list, normalize_provider

log = logging.getLogger(__name__)

ErrorCallback = Callable[[FabricError], None]
_engine_ids = itertools.count(1)
_SHM_DIR = Path("/dev/shm")
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux >= 6.1; EINVAL before
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# Context slots beyond the receive buffers' that `max_inflight_ops` must leave for writes and
# sends: each posted receive holds one slot for the engine's life.
MIN_FREE_OP_SLOTS = 64
# Longest single CQ wait or spin (`idle_wait_us`, `spin_us`): a third of the watchdog's 3 s,
# which would take a longer one for a provider call stuck and abandon an idle engine.
MAX_POLL_US = 1_000_000
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass(frozen=True)
class EngineStats:
    progress: ProgressStats
    imm: ImmStats
    callback_errors: int


@dataclass(frozen=True, eq=False)
class PreparedWrites:
    """Writes checked and laid out by `TransferEngine.prepare_writes`, to be queued later in
    row ranges by `submit_prepared`; valid only with the engine that prepared them."""

    src: MemoryRegionHandle
    peer: PeerHandle
    dst: MemoryRegionDescriptor
    pointers: tuple[Any, Any, Any] = field(repr=False)  # native local addr, length, remote addr
    arrays: tuple[np.ndarray, ...] = field(repr=False)  # what the pointers point into
    ends: list[int] = field(repr=False)  # ends[i]: bytes of rows [0, i)

    def __len__(self) -> int:
        return len(self.ends) - 1


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
    ) -> None:
        _check_slots(max_inflight_ops, num_receive_buffers)
        _check_poll_waits(spin_us, idle_wait_us)
        self._id = next(_engine_ids)
        self._closed = False  # refuses new work; set first by `close`
        self._released = False  # teardown done: the endpoint is freed (or left to leak)
        self._teardown_owed = False  # `close` could not wait: the loop tears down as it ends
        self._peer_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._native: Any = None
        self._regions: dict[int, MemoryRegionHandle] = {}
        self._peers: dict[bytes, PeerHandle] = {}
        self._next_key = 1
        self.op_timeout = op_timeout
        self.submit_timeout = submit_timeout
        self.max_message_bytes = max_message_bytes
        provider = normalize_provider(provider)
        # None: on where the peer's kernel reads our pages one by one (module docstring).
        self._huge_pages = provider == "shm" if huge_pages is None else huge_pages
        # shm ignores node names; tcp needs one to stay on loopback (ENV.md).
        node_arg = None if provider == "shm" else node
        self.info, self._native = self._open(provider, node_arg, domain, max_inflight_ops, hmem)
        try:
            self.address = self._getname()
            self._pools = MessagePools(max_message_bytes, num_send_buffers, num_receive_buffers)
            self._pools.register(lambda array: self._register_native(self._extent(array)).desc)
            self.counters = ImmCounters()
            self._dispatcher = CallbackDispatcher(f"fabric-callbacks-{self._id}")
            if idle_wait_us is None:
                # With a CQ fd the idle thread wakes on traffic; without one it must poll.
                idle_wait_us = 20_000 if lib.pd_engine_wait_fd(self._native) >= 0 else 200
            self._loop = ProgressLoop(
                self._native,
                name=f"fabric-progress-{self._id}",
                counters=self.counters,
                dispatcher=self._dispatcher,
                pools=self._pools,
                max_queued_submits=max_queued_submits,
                spin_us=spin_us,
                idle_spin_us=idle_spin_us,
                idle_wait_us=idle_wait_us,
                provider_name=self.info.provider,
                regions=self._regions,
                on_ended=self._on_loop_ended,
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
    def threads(self) -> tuple[threading.Thread, threading.Thread]:
        return self._loop.thread, self._dispatcher.thread

    def max_pages_per_run(self, page_bytes: int) -> int | None:
        """The split the engine applies to long runs (None: never split on this provider)."""
        limit = self.max_write_bytes // page_bytes
        return None if limit >= 1 << 40 else max(1, limit)

    # -- setup --------------------------------------------------------------------------------

    @staticmethod
    def _open(
        provider: str, node: str | None, domain: str | None, num_slots: int, hmem: bool
    ) -> tuple[FabricInfo, Any]:
        with fi_info_list(provider, node, want_hmem=hmem) as info_list:
            infos = describe(info_list)
            index = 0
            if domain is not None:
                names = [info.domain for info in infos]
                if domain not in names:
                    raise FabricUnavailableError(f"{provider}: no domain {domain!r} in {names}")
                index = names.index(domain)
            error = ffi.new("char[256]")
            native = lib.pd_engine_open(info_list, index, num_slots, error, len(error))
            if native == ffi.NULL:
                raise ProviderError(f"{provider}: {ffi.string(error).decode()}")
            return infos[index], native

    def _getname(self) -> bytes:
        buffer = ffi.new("char[]", MAX_ADDRESS_BYTES)
        length = ffi.new("size_t *", MAX_ADDRESS_BYTES)
        rc = lib.pd_engine_getname(self._native, buffer, length)
        if rc != 0:
            raise ProviderError(f"fi_getname: {strerror(rc)}", -rc)
        return bytes(ffi.buffer(buffer, length[0]))

    def _register_native(self, extent: BufferExtent) -> MemoryRegionHandle:
        key = self._next_key
        self._next_key += 1
        mr = ffi.new("struct fid_mr **")
        key_out = ffi.new("uint64_t *")
        desc = ffi.new("void **")
        rc = lib.pd_mr_reg(
            self._native,
            ffi.cast("void *", extent.address),
            extent.length,
            key,
            extent.cuda_device,
            mr,
            key_out,
            desc,
        )
        if rc != 0:
            where = "host" if extent.cuda_device < 0 else f"cuda:{extent.cuda_device}"
            raise RegistrationError(
                f"fi_mr_regattr of {extent.length} bytes of {where} memory: {strerror(rc)} ({rc})"
            )
        handle = MemoryRegionHandle(
            extent.address,
            extent.length,
            int(key_out[0]),
            self._id,
            mr[0],
            desc[0],
            extent.keep_alive,  # for a bytearray: its cffi view, which pins it against resizing
        )
        self._regions[id(handle)] = handle
        return handle

    # -- memory and peers -----------------------------------------------------------------------

    def _extent(self, buffer: object) -> BufferExtent:
        extent = buffer_extent(buffer)
        if extent.cuda_device >= 0 and not self.hmem:
            raise RegistrationError(
                f"cuda:{extent.cuda_device} memory needs an engine opened with hmem=True "
                f"(FI_HMEM); this {self.provider} engine registers host memory only"
            )
        return extent

    def register(self, buffer: object) -> tuple[MemoryRegionHandle, MemoryRegionDescriptor]:
        """Register host memory (torch CPU tensor, numpy array, bytearray, memoryview) or, on
        an engine opened with ``hmem=True``, a CUDA tensor (`BufferExtent.cuda_device`).

        Returns the local handle (source of writes) and the descriptor to give peers (target of
        their writes). The engine keeps `buffer` alive until `deregister` (and the last write
        from it) or `close`.
        With `huge_pages`, a host region's 2 MiB-aligned interior is moved to huge pages first
        (module docstring; a copy of it, on this thread, before the provider sees the region).
        """
        self._check_open()
        extent = self._extent(buffer)  # typed errors on this thread, before the provider
        if self._huge_pages and extent.cuda_device < 0:
            advise_huge_pages(extent.address, extent.length)
        handle: MemoryRegionHandle = self._loop.call(lambda: self._register_native(extent))
        virt = bool(self.info.mr_mode & lib.FI_MR_VIRT_ADDR)
        descriptor = MemoryRegionDescriptor(
            self.provider, handle.address if virt else 0, handle.length, handle.key, virt
        )
        return handle, descriptor

    def deregister(self, handle: MemoryRegionHandle) -> None:
        """Release a region. New writes from it are refused at once; writes from it still
        queued or posted go on, and its registration is closed when the last of them has
        ended (at once when none is; a peer's writes into it are the caller's to stop first).
        Writes posted to a failed peer may never end: then it stays registered until `close`.
        """
        self._check_open()
        # Removed from `_regions` on the progress thread: if this raises (engine closed
        # meanwhile), the region is still there and `close` releases it.
        self._loop.call(lambda: self._loop.release_region(handle))

    def add_peer(self, address: bytes) -> PeerHandle:
        """Insert a peer's `address` (its `engine.address`); idempotent per address, also
        when threads race (one handle per address)."""
        self._check_open()
        address = bytes(address)
        known = self._peers.get(address)  # the common case, without waiting for the lock
        if known is not None:
            return known
        with self._peer_lock:
            known = self._peers.get(address)
            if known is not None:
                return known
            self._check_address(address)
            peer: PeerHandle = self._loop.call(lambda: self._insert_peer(address))
            self._peers[address] = peer
            return peer

    def forget_peer(self, address: bytes) -> None:
        """Forget what is cached of ``address`` (its failed state): its process was replaced
        by a new one at the same address. The next `add_peer` resolves it afresh.

        The handle is refused from now on; its address-vector entry is removed as soon as no
        call addressed to it is queued or has ops posted (at once, usually). Ops posted to a
        dead shm peer never complete, so such an entry stays until the engine closes."""
        self._check_open()
        with self._peer_lock:
            peer = self._peers.pop(bytes(address), None)
            if peer is not None:
                self._loop.call(lambda: self._loop.peers.retire(peer))

    def peer_failure(self, address: bytes) -> FabricError | None:
        """Why the peer at ``address`` failed (None: it has not): `PeerFailedError` for a
        dropped connection or an exited process, `OperationTimeoutError` when an operation only
        missed its deadline (the peer may still be alive, e.g. stopped or slow), its subclass
        `PeerStuckError` when a post to it never returned and the engine was abandoned."""
        peer = self._peers.get(bytes(address))
        if peer is None:
            return None
        return self._loop.peers.failure(peer.fi_addr)

    def closed_reason(self) -> str | None:
        """Why the engine takes no more work (closed, abandoned by its watchdog, or its progress
        thread died); None while it works. Registered memory stays writable by peers until
        `close`: an abandoned engine cannot deregister it."""
        return "engine is closed" if self._closed else self._loop.closed_reason()

    def _check_address(self, address: bytes) -> None:
        own = self.address
        if not address or len(address) > MAX_ADDRESS_BYTES:
            raise AddressError(f"peer address of {len(address)} bytes")
        scheme = own.split(b"://", 1)[0] + b"://" if b"://" in own else None
        if scheme is not None and not address.startswith(scheme):
            raise AddressError(f"not a {self.provider} address: {address[:32]!r}")
        # Binary (sockaddr) formats: same length and address family as ours.
        if scheme is None and (len(address) != len(own) or address[:2] != own[:2]):
            raise AddressError(
                f"not a {self.provider} address: {len(address)} bytes {address[:16].hex()}"
            )
        if self.provider == "shm":
            # shm accepts any name into its AV and silently reuses the slot when no such
            # region exists; refuse names with no region on this host up front.
            name = address[len(scheme or b"") :].rstrip(b"\0").decode(errors="replace")
            if "/" in name or not (_SHM_DIR / name).exists():
                raise AddressError(f"no shm endpoint {name!r} on this host (peer not running?)")

    def _insert_peer(self, address: bytes) -> PeerHandle:
        """On the progress thread, under `_peer_lock`: the handle for ``address``."""
        # The provider may read a fixed-size name: hand it a zero-padded copy.
        raw = ffi.new("char[]", address + bytes(MAX_ADDRESS_BYTES - len(address) + 1))
        text = ffi.new("char[]", 128)
        name = address.hex()
        if lib.pd_av_straddr(self._native, raw, text, len(text)) == 0:
            name = ffi.string(text).decode(errors="replace")
        # Forgotten, but its entry is still in the AV (a call to it is not over): keep it.
        fi_addr = self._loop.peers.reclaim(address)
        if fi_addr is None:
            out = ffi.new("fi_addr_t *")
            rc = lib.pd_av_insert(self._native, raw, out)
            if rc != 0:
                raise AddressError(f"fi_av_insert of {address!r}: {strerror(rc)} ({rc})")
            fi_addr = int(out[0])
        for other in list(self._peers.values()):
            if other.fi_addr == fi_addr and other.address != address:
                # The provider reused the slot of an entry it never really kept.
                log.warning("peer %s replaced stale AV entry of %s", name, other.name)
                del self._peers[other.address]
                self._loop.peers.clear_failure(fi_addr)
        peer = PeerHandle(address, fi_addr, name)
        self._loop.peers.adopt(peer)
        return peer

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
        self._check_write(src, peer, dst, imm)
        if length <= 0 or length > self.max_write_bytes:
            raise OutOfRangeError(f"write length {length} is not in [1, max_msg_size]")
        _check_span("source region", src_offset, length, src.length)
        _check_span("destination descriptor", dst_offset, length, dst.length)
        # One op: a 3-element native array (local address, length, remote address) is much
        # cheaper than the numpy path of paged writes on this per-call hot path.
        row = ffi.new("uint64_t[3]", [src.address + src_offset, length, dst.base + dst_offset])
        arrays = (row, row + 1, row + 2)
        self._queue_write(
            src, peer, dst, arrays, row, 1, length, imm, on_done, on_error, on_unposted
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
        src_stride = page_bytes if src_stride is None else src_stride
        dst_stride = page_bytes if dst_stride is None else dst_stride
        if page_bytes <= 0 or src_stride < page_bytes or dst_stride < page_bytes:
            raise OutOfRangeError(
                f"page_bytes {page_bytes} must be positive and <= strides {src_stride}/{dst_stride}"
            )
        runs = paging.coalesce_page_runs(
            src_pages,
            dst_pages,
            coalesce=paging.can_coalesce(page_bytes, src_stride, dst_stride),
            max_pages_per_run=self.max_pages_per_run(page_bytes),
        )
        _check_page_arithmetic(runs, page_bytes, (src_offset, src_stride), (dst_offset, dst_stride))
        ops = np.empty((runs.shape[0], 3), dtype=np.int64)
        ops[:, 0] = src_offset + runs[:, 0] * src_stride
        ops[:, 1] = dst_offset + runs[:, 1] * dst_stride
        ops[:, 2] = runs[:, 2] * page_bytes
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
        rows = _rows(ops)
        if rows.shape[0] == 0:
            self._check_open()
            if on_done is not None:
                self._dispatcher.submit(on_done)
            return 0
        self._check_write(src, peer, dst, imm)
        prepared = self._lay_out(src, peer, dst, rows)
        self._queue_prepared(prepared, 0, len(prepared), imm, on_done, on_error, on_unposted)
        return len(prepared)

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
        rows = _rows(ops)
        if rows.shape[0] == 0:
            raise OutOfRangeError("no writes to prepare")
        self._check_write(src, peer, dst, None)
        return self._lay_out(src, peer, dst, rows)

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
        once after all of them completed locally (``on_unposted``: see `submit_writes`). Only the engine, region, peer and ``imm`` are
        checked again (the region may have been deregistered or the peer failed since)."""
        if not 0 <= start < stop <= len(prepared):
            raise OutOfRangeError(f"rows [{start}, {stop}) of {len(prepared)} prepared writes")
        self._check_write(prepared.src, prepared.peer, prepared.dst, imm)
        self._queue_prepared(prepared, start, stop, imm, on_done, on_error, on_unposted)

    def _lay_out(
        self,
        src: MemoryRegionHandle,
        peer: PeerHandle,
        dst: MemoryRegionDescriptor,
        rows: np.ndarray,
    ) -> PreparedWrites:
        """Range-check ``rows`` (non-empty) and build their native arrays."""
        src_off, dst_off, lengths = rows[:, 0], rows[:, 1], rows[:, 2]
        if int(lengths.min()) <= 0:
            raise OutOfRangeError("every write needs a positive length")
        _check_extent("source region", src_off, lengths, src.length)
        _check_extent("destination descriptor", dst_off, lengths, dst.length)
        if int(lengths.max()) > self.max_write_bytes:
            raise OutOfRangeError(f"write of {int(lengths.max())} bytes exceeds max_msg_size")
        laddr = (src_off + src.address).astype(np.uint64)
        raddr = (dst_off + dst.base).astype(np.uint64)
        lens = lengths.astype(np.uint64)
        pointers = tuple(ffi.cast("uint64_t *", ffi.from_buffer(a)) for a in (laddr, lens, raddr))
        ends = np.concatenate(([0], np.cumsum(lengths))).tolist()
        return PreparedWrites(src, peer, dst, pointers, (laddr, lens, raddr), ends)

    def _queue_prepared(
        self,
        prepared: PreparedWrites,
        start: int,
        stop: int,
        imm: int | None,
        on_done: Callable[[], None] | None,
        on_error: ErrorCallback | None,
        on_unposted: UnpostedCallback | None = None,
    ) -> None:
        laddr, lens, raddr = prepared.pointers
        self._queue_write(
            prepared.src,
            prepared.peer,
            prepared.dst,
            (laddr + start, lens + start, raddr + start),
            prepared,
            stop - start,
            prepared.ends[stop] - prepared.ends[start],
            imm,
            on_done,
            on_error,
            on_unposted,
        )

    def _check_write(
        self,
        src: MemoryRegionHandle,
        peer: PeerHandle,
        dst: MemoryRegionDescriptor,
        imm: int | None,
    ) -> None:
        self._check_open()
        self._check_local(src)
        self._check_peer(peer)
        if dst.provider != self.provider:
            raise DescriptorError(
                f"descriptor is for {dst.provider!r}, engine is {self.provider!r}"
            )
        self._check_imm(imm)

    def _queue_write(
        self,
        src: MemoryRegionHandle,
        peer: PeerHandle,
        dst: MemoryRegionDescriptor,
        arrays: tuple[Any, ...],
        keep_alive: object,
        num_ops: int,
        num_bytes: int,
        imm: int | None,
        on_done: Callable[[], None] | None,
        on_error: ErrorCallback | None,
        on_unposted: UnpostedCallback | None = None,
    ) -> None:
        job = Job(
            job_id=self._loop.new_job_id(),
            kind=WRITE,
            peer=peer,
            total=num_ops,
            deadline=time.monotonic() + self.op_timeout,
            on_done=on_done,
            on_error=on_error,
            arrays=arrays,
            region=src,
            key=dst.key,
            imm=imm,
            byte_count=num_bytes,
            keep_alive=keep_alive,
            on_unposted=on_unposted,
        )
        self._loop.enqueue(job, self.submit_timeout)

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
        self._check_open()
        self._check_peer(peer)
        if len(payload) > self.max_message_bytes:
            raise MessageTooLargeError(
                f"message of {len(payload)} bytes exceeds max_message_bytes={self.max_message_bytes}"
            )
        job = Job(
            job_id=self._loop.new_job_id(),
            kind=SEND,
            peer=peer,
            total=1,
            deadline=time.monotonic() + self.op_timeout,
            on_done=on_done,
            on_error=on_error,
            payload=MessagePools.frame(self.address, bytes(payload)),
        )
        self._loop.enqueue(job, self.submit_timeout)

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

    def _check_local(self, handle: MemoryRegionHandle) -> None:
        if handle.engine_id != self._id or id(handle) not in self._regions:
            raise RegistrationError("memory region handle is not registered with this engine")

    def _check_peer(self, peer: PeerHandle) -> None:
        if self._peers.get(peer.address) is not peer:
            raise AddressError(f"peer {peer.name} was not added to this engine")

    def _check_imm(self, imm: int | None) -> None:
        if imm is not None and not 0 <= imm < 1 << self.imm_bits:
            raise ImmError(f"imm {imm:#x} does not fit {self.imm_bits} bits on {self.provider}")

    # -- teardown -------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return EngineStats(self._loop.stats, self.counters.stats(), self._dispatcher.errors)

    def close(self, timeout: float = 10.0) -> None:
        """Fail what is outstanding (`EngineClosedError`), stop both threads, free every fid.

        Idempotent. From inside a callback the callback thread is stopped without waiting.
        Where it cannot wait for the progress thread (called on it, from an inline callback,
        or the thread is still in a provider call after ``timeout``), that thread completes
        the teardown as it ends; a later `close` waits for it again.
        """
        self._closed = True
        self._loop.stop()
        on_loop = threading.current_thread() is self._loop.thread
        if not on_loop:
            self._loop.thread.join(timeout)
        with self._close_lock:
            if not self._loop.work_ended:
                self._teardown_owed = True  # `_on_loop_ended` reads it under this lock
                if not on_loop:
                    log.error(
                        "fabric progress thread did not stop within %.3g s; it completes the "
                        "teardown when it does", timeout,
                    )  # fmt: skip
                return
        self._teardown(timeout)

    def _on_loop_ended(self) -> None:
        """The loop's work is over (its thread, or the watchdog's once it abandoned the
        loop): complete a `close` that could not wait for it."""
        with self._close_lock:
            owed, self._teardown_owed = self._teardown_owed, False
        if owed:
            # Never wait here for the callback thread: a callback may be waiting for us.
            self._teardown(0.0)

    def _teardown(self, timeout: float) -> None:
        """Stop the callback thread once what is queued ran, then free the endpoint."""
        self._dispatcher.close(timeout)  # again on a later close: waits for the thread
        with self._close_lock:
            if self._released:
                return
            self._released = True
            if self._loop.abandoned:
                # Its stuck call may return some day. Nothing polled it since, while peers
                # went on writing: closing such an endpoint crashed tcp;ofi_rxm (libfabric
                # 1.17) in tests.
                log.error("fabric engine was abandoned; leaking its endpoint")
                return
            self._release_native()

    def _release_native(self) -> None:
        loop: ProgressLoop | None = getattr(self, "_loop", None)
        deferred = [] if loop is None else loop.closing_regions()
        if loop is not None:
            loop.detach_native()  # a late wake must not reach the freed engine
        for handle in [*self._regions.values(), *deferred]:
            rc = lib.pd_mr_close(handle.mr)
            if rc != 0:
                log.error("fi_close of a memory region: %s (%d)", strerror(rc), rc)
        self._regions.clear()
        if self._native is not None:
            rc = lib.pd_engine_close(self._native)
            self._native = None
            if rc != 0:
                log.error("closing the %s endpoint: %s (%d)", self.provider, strerror(rc), rc)

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def advise_huge_pages(address: int, length: int) -> int:
    """Back the 2 MiB-aligned interior of ``[address, address + length)`` with transparent
    huge pages; returns the bytes now advised and collapsed (0: nothing done or refused)."""
    start = -(-address // _HUGE_PAGE) * _HUGE_PAGE
    end = (address + length) // _HUGE_PAGE * _HUGE_PAGE
    if end <= start or not _thp_allowed():
        return 0
    madvise = _libc().madvise
    # MADV_HUGEPAGE keeps later faults (and khugepaged) on huge pages; MADV_COLLAPSE converts
    # what is already faulted in, now: KV pools are zero-filled when allocated.
    for advice in (_MADV_HUGEPAGE, _MADV_COLLAPSE):
        if madvise(start, end - start, advice) != 0:
            log.debug(
                "madvise(%d) of %d bytes at %#x refused: errno %d",
                advice, end - start, start, ctypes.get_errno(),
            )  # fmt: skip
            return 0
    return end - start


@functools.cache
def _thp_allowed() -> bool:
    try:
        return "[never]" not in _THP_ENABLED.read_text()
    except OSError:
        return False


@functools.cache
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def _check_slots(max_inflight_ops: int, num_receive_buffers: int) -> None:
    if max_inflight_ops < num_receive_buffers + MIN_FREE_OP_SLOTS:
        raise ValueError(
            f"max_inflight_ops={max_inflight_ops} must exceed num_receive_buffers="
            f"{num_receive_buffers} by at least {MIN_FREE_OP_SLOTS}: every posted "
            f"receive buffer holds one of the max_inflight_ops operation contexts for good, "
            f"and writes and sends share the rest"
        )


def _check_poll_waits(spin_us: int, idle_wait_us: int | None) -> None:
    for name, value in (("spin_us", spin_us), ("idle_wait_us", idle_wait_us)):
        if value is not None and not 0 <= value <= MAX_POLL_US:
            raise ValueError(
                f"{name}={value} must be in [0, {MAX_POLL_US}]: one wait longer than that "
                f"looks like a stuck provider call to the watchdog, which abandons the engine"
            )


def _check_span(what: str, offset: int, length: int, limit: int) -> None:
    if offset < 0 or offset + length > limit:
        raise OutOfRangeError(
            f"write [{offset}, {offset + length}) is outside the {what} of {limit} bytes"
        )


def _rows(ops: np.ndarray) -> np.ndarray:
    rows = np.asarray(ops, dtype=np.int64)
    if rows.ndim != 2 or rows.shape[1] != 3:
        raise OutOfRangeError(f"ops must be rows of (src, dst, length), got {rows.shape}")
    return rows


def _check_page_arithmetic(
    runs: np.ndarray, page_bytes: int, src: tuple[int, int], dst: tuple[int, int]
) -> None:
    """The int64 arithmetic that turns ``runs`` into byte rows (``offset + page * stride``,
    ``pages * page_bytes``; ``src``/``dst`` are ``(offset, stride)``) cannot wrap around:
    checked in Python ints. Beyond int64 is outside every region, hence out of range."""
    if runs.shape[0] == 0:
        return
    for what, (offset, stride), column in (("source", src, 0), ("destination", dst, 1)):
        span = int(runs[:, column].max()) * stride
        if offset < _INT64_MIN or max(stride, span, offset + span) + page_bytes > _INT64_MAX:
            raise OutOfRangeError(
                f"{what} page at byte offset {offset + span} (+{page_bytes}) is outside any region"
            )
    if int(runs[:, 2].max()) * page_bytes > _INT64_MAX:
        raise OutOfRangeError(f"a run of {int(runs[:, 2].max())} pages is outside any region")


def _check_extent(what: str, offsets: np.ndarray, lengths: np.ndarray, limit: int) -> None:
    """Every row ``[offset, offset + length)`` (lengths positive) lies in ``[0, limit)``.

    Never forms ``offsets + lengths``: int64 sums wrap (2**62 + 2**62 < 0). With the lengths
    in ``[1, limit]``, ``limit - lengths`` cannot overflow, and offsets are compared to it."""
    limit = min(limit, _INT64_MAX)  # a descriptor may claim up to 2**64 - 1 bytes
    outside = (offsets < 0) | (lengths > limit) | (offsets > limit - lengths)
    if outside.any():
        bad = int(np.argmax(outside))
        start, end = int(offsets[bad]), int(offsets[bad]) + int(lengths[bad])  # Python ints
        raise OutOfRangeError(f"write [{start}, {end}) is outside the {what} of {limit} bytes")
