"""Memory registration of one engine: its regions, their descriptors, huge pages, and when a
deregistered region's registration may close.

Huge pages (shm). libfabric 1.17's shm moves every write above its inject size by CMA: the
target's progress thread calls process_vm_readv on the initiator's memory, and the kernel pins
and copies the source one page at a time. From 4 KiB pages that copy runs at ~0.75x the rate it
reaches from 2 MiB transparent huge pages (bench/history/RESULTS-notebook.md, "Transfer: the shm gap"). numpy
asks for huge pages for its large arrays; torch's CPU allocator does not, so a KV pool in a
torch tensor was the slow case. Registration therefore backs the 2 MiB-aligned interior of a
host region with huge pages (`huge_pages`, default on for shm): MADV_HUGEPAGE, then
MADV_COLLAPSE (Linux >= 6.1) to convert the pages already faulted in, contents kept. Nothing is
done when the system disabled THP ("never"); a kernel or mapping that refuses only loses the
speed-up. tcp leaves pages alone by default (`huge_pages=True` turns it on): its sockets copy
the bytes anyway, and seven transfer-bench runs showed no clear gain (bench/history/RESULTS-notebook.md, "tcp
regions on huge pages").

Device memory. An engine opened with FI_HMEM (and FI_MR_HMEM) also registers CUDA tensors: the
region is registered with ``FI_HMEM_CUDA`` and its device, and the NIC reads and writes GPU
pages directly (GPUDirect RDMA on verbs / efa; CUDA IPC on a libfabric shm built with CUDA). A
CUDA tensor given to an engine opened without it fails with `RegistrationError`, before the
provider sees it.

Deregistration. A write job holds its source region (`Job.region`) from `ProgressLoop.enqueue`
until the job is forgotten: `RegionUses.deregister` closes a region's registration at once when
no job uses it, else when the last one is forgotten (closing it under a queued or posted op is a
use-after-free).
"""

from __future__ import annotations

import collections
import ctypes
import functools
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.fabric._lib import ffi, lib, strerror
from workers.fabric.descriptors import MemoryRegionDescriptor
from workers.fabric.errors import RegistrationError
from workers.fabric.handles import BufferExtent, MemoryRegionHandle, buffer_extent
from workers.fabric.providers import FabricInfo

if TYPE_CHECKING:
    from workers.fabric._fabric_cffi import PdEngine

log = logging.getLogger(__name__)

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux >= 6.1; EINVAL before
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


class Registrations:
    """The regions registered with one engine's domain, by ``id`` of their handle.

    `extent` runs on the caller's thread (typed errors before the provider sees anything);
    `register_native` on the progress thread (`ProgressLoop.call`), or inline before it starts.
    """

    def __init__(
        self, native: PdEngine, engine_id: int, info: FabricInfo, huge_pages: bool
    ) -> None:
        self.native = native
        self.engine_id = engine_id
        self.info = info
        self.huge_pages = huge_pages
        # Shared with the progress loop (`RegionUses`), which removes deregistered ones.
        self.regions: dict[int, MemoryRegionHandle] = {}
        self._next_key = 1

    def extent(self, buffer: object) -> BufferExtent:
        """Where ``buffer``'s bytes are; refuses CUDA memory on an engine without FI_HMEM."""
        extent = buffer_extent(buffer)
        if extent.cuda_device >= 0 and not self.info.hmem:
            raise RegistrationError(
                f"cuda:{extent.cuda_device} memory needs an engine opened with hmem=True "
                f"(FI_HMEM); this {self.info.provider} engine registers host memory only"
            )
        return extent

    def prepare(self, buffer: object) -> BufferExtent:
        """`extent`, with a host region's interior moved to huge pages first when asked (a
        copy of it, on this thread, before the provider sees the region)."""
        extent = self.extent(buffer)
        if self.huge_pages and extent.cuda_device < 0:
            advise_huge_pages(extent.address, extent.length)
        return extent

    def register_native(self, extent: BufferExtent) -> MemoryRegionHandle:
        """Register ``extent`` with the domain (progress thread, or before it starts)."""
        key = self._next_key
        self._next_key += 1
        mr = ffi.new("struct fid_mr **")
        key_out = ffi.new("uint64_t *")
        desc = ffi.new("void **")
        rc = lib.pd_mr_reg(
            self.native,
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
            self.engine_id,
            mr[0],
            desc[0],
            extent.keep_alive,  # for a bytearray: its cffi view, which pins it against resizing
        )
        self.regions[id(handle)] = handle
        return handle

    def descriptor(self, handle: MemoryRegionHandle) -> MemoryRegionDescriptor:
        """What peers need to write into ``handle``'s region."""
        virt = bool(self.info.mr_mode & lib.FI_MR_VIRT_ADDR)
        return MemoryRegionDescriptor(
            self.info.provider, handle.address if virt else 0, handle.length, handle.key, virt
        )

    def check_local(self, handle: MemoryRegionHandle) -> None:
        """Raise unless ``handle`` is registered here (and not deregistered)."""
        if handle.engine_id != self.engine_id or id(handle) not in self.regions:
            raise RegistrationError("memory region handle is not registered with this engine")

    def close_all(self, deferred: list[MemoryRegionHandle]) -> None:
        """Engine teardown: close every registration, ``deferred`` ones (deregistered while
        jobs still used them) too."""
        for handle in [*self.regions.values(), *deferred]:
            close_region(handle)
        self.regions.clear()


class RegionUses:
    """How many queued or posted jobs write from each registered region, and the regions
    deregistered while some still did (module docstring). Shares the progress loop's lock,
    under which `enqueue` admits jobs."""

    def __init__(self, regions: dict[int, MemoryRegionHandle], lock: threading.Condition) -> None:
        self._regions = regions
        self._lock = lock
        self._jobs: collections.Counter[int] = collections.Counter()
        self._closing: dict[int, MemoryRegionHandle] = {}

    def hold(self, handle: MemoryRegionHandle) -> None:
        """A job will write from ``handle`` (the caller holds the lock)."""
        if self._regions.get(id(handle)) is not handle:
            raise RegistrationError("memory region handle was deregistered")
        self._jobs[id(handle)] += 1

    def release(self, handle: MemoryRegionHandle) -> None:
        """A job writing from ``handle`` is forgotten: close the region if it was
        deregistered and this was its last job."""
        key = id(handle)
        with self._lock:
            self._jobs[key] -= 1
            if self._jobs[key]:
                return
            del self._jobs[key]
            closing = self._closing.pop(key, None)
        if closing is not None:
            close_region(closing)

    def deregister(self, handle: MemoryRegionHandle) -> None:
        """Deregister ``handle`` (progress thread): new jobs from it are refused, and its
        registration is closed now, or when the last job writing from it is forgotten."""
        key = id(handle)
        with self._lock:
            if self._regions.get(key) is not handle:
                return
            del self._regions[key]
            if self._jobs[key]:
                self._closing[key] = handle
                return
        close_region(handle)

    def take_closing(self) -> list[MemoryRegionHandle]:
        """Regions deregistered while jobs still used them, not closed yet (engine teardown)."""
        with self._lock:
            handles = list(self._closing.values())
            self._closing.clear()
        return handles


def close_region(handle: MemoryRegionHandle) -> None:
    rc = lib.pd_mr_close(handle.mr)
    if rc != 0:
        log.error("fi_close of a memory region: %s (%d)", strerror(rc), rc)


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
