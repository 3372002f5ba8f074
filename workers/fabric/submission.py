"""From a submitting call to a queued job: the checks every write or send repeats, and the
`Job` it becomes.

Each check runs on the caller's thread, so a bad call raises there and queues nothing: the
engine is open, the source region is registered here, the peer was added here, the descriptor
is for this provider, and ``imm`` fits the provider's immediate data. The range checks and the
native layout of write rows are `write_checks`. What each call means (callbacks, rows, prepared
writes) is documented on `TransferEngine`, whose submit methods call these.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from workers.fabric._lib import ffi
from workers.fabric.addresses import PeerDirectory
from workers.fabric.callbacks import CallbackDispatcher
from workers.fabric.descriptors import MemoryRegionDescriptor
from workers.fabric.errors import (
    DescriptorError,
    EngineClosedError,
    ImmError,
    MessageTooLargeError,
    OutOfRangeError,
)
from workers.fabric.handles import MemoryRegionHandle, PeerHandle
from workers.fabric.jobs import SEND, WRITE, ErrorCallback, Job, UnpostedCallback
from workers.fabric.messages import MessagePools
from workers.fabric.progress import ProgressLoop
from workers.fabric.providers import FabricInfo
from workers.fabric.registration import Registrations
from workers.fabric.write_checks import PreparedWrites, check_span, lay_out, rows_of

if TYPE_CHECKING:
    from workers.fabric._fabric_cffi import IntPointer


class Submitter:
    """Checks and queues the submissions of one engine."""

    def __init__(
        self,
        *,
        loop: ProgressLoop,
        registry: Registrations,
        peers: PeerDirectory,
        dispatcher: CallbackDispatcher,
        info: FabricInfo,
        address: bytes,
        max_message_bytes: int,
        is_closed: Callable[[], bool],
        op_timeout: float,
        submit_timeout: float,
    ) -> None:
        self._loop = loop
        self._registry = registry
        self._peers = peers
        self._dispatcher = dispatcher
        self._provider = info.provider
        self._imm_bits = info.imm_bits
        self._max_write_bytes = info.max_msg_size
        self._address = address
        self._max_message_bytes = max_message_bytes
        self._is_closed = is_closed
        # The engine's settings (`TransferEngine.op_timeout` / `submit_timeout` set these).
        self.op_timeout = op_timeout
        self.submit_timeout = submit_timeout

    # -- checks ---------------------------------------------------------------------------------

    def check_open(self) -> None:
        if self._is_closed():
            raise EngineClosedError("engine is closed")

    def check_imm(self, imm: int | None) -> None:
        if imm is not None and not 0 <= imm < 1 << self._imm_bits:
            raise ImmError(f"imm {imm:#x} does not fit {self._imm_bits} bits on {self._provider}")

    def check_write(
        self,
        src: MemoryRegionHandle,
        peer: PeerHandle,
        dst: MemoryRegionDescriptor,
        imm: int | None,
    ) -> None:
        self.check_open()
        self._registry.check_local(src)
        self._peers.check(peer)
        if dst.provider != self._provider:
            raise DescriptorError(
                f"descriptor is for {dst.provider!r}, engine is {self._provider!r}"
            )
        self.check_imm(imm)

    # -- writes ---------------------------------------------------------------------------------

    def write(
        self,
        src: MemoryRegionHandle,
        src_offset: int,
        peer: PeerHandle,
        dst: MemoryRegionDescriptor,
        dst_offset: int,
        length: int,
        imm: int | None,
        on_done: Callable[[], None] | None,
        on_error: ErrorCallback | None,
        on_unposted: UnpostedCallback | None,
    ) -> None:
        """`TransferEngine.submit_write`."""
        self.check_write(src, peer, dst, imm)
        if length <= 0 or length > self._max_write_bytes:
            raise OutOfRangeError(f"write length {length} is not in [1, max_msg_size]")
        check_span("source region", src_offset, length, src.length)
        check_span("destination descriptor", dst_offset, length, dst.length)
        # One op: a 3-element native array (local address, length, remote address) is much
        # cheaper than the numpy path of paged writes on this per-call hot path.
        row = ffi.new("uint64_t[3]", [src.address + src_offset, length, dst.base + dst_offset])
        arrays: tuple[IntPointer, IntPointer, IntPointer] = (row, row + 1, row + 2)
        self._queue_write(
            src, peer, dst, arrays, row, 1, length, imm, on_done, on_error, on_unposted
        )

    def rows(
        self,
        src: MemoryRegionHandle,
        peer: PeerHandle,
        dst: MemoryRegionDescriptor,
        ops: np.ndarray,
        imm: int | None,
        on_done: Callable[[], None] | None,
        on_error: ErrorCallback | None,
        on_unposted: UnpostedCallback | None,
    ) -> int:
        """`TransferEngine.submit_writes`."""
        rows = rows_of(ops)
        if rows.shape[0] == 0:
            self.check_open()
            if on_done is not None:
                self._dispatcher.submit(on_done)
            return 0
        self.check_write(src, peer, dst, imm)
        prepared = lay_out(src, peer, dst, rows, self._max_write_bytes)
        self._queue_prepared(prepared, 0, len(prepared), imm, on_done, on_error, on_unposted)
        return len(prepared)

    def prepare(
        self,
        src: MemoryRegionHandle,
        peer: PeerHandle,
        dst: MemoryRegionDescriptor,
        ops: np.ndarray,
    ) -> PreparedWrites:
        """`TransferEngine.prepare_writes`."""
        rows = rows_of(ops)
        if rows.shape[0] == 0:
            raise OutOfRangeError("no writes to prepare")
        self.check_write(src, peer, dst, None)
        return lay_out(src, peer, dst, rows, self._max_write_bytes)

    def prepared(
        self,
        prepared: PreparedWrites,
        start: int,
        stop: int,
        imm: int | None,
        on_done: Callable[[], None] | None,
        on_error: ErrorCallback | None,
        on_unposted: UnpostedCallback | None,
    ) -> None:
        """`TransferEngine.submit_prepared`."""
        if not 0 <= start < stop <= len(prepared):
            raise OutOfRangeError(f"rows [{start}, {stop}) of {len(prepared)} prepared writes")
        self.check_write(prepared.src, prepared.peer, prepared.dst, imm)
        self._queue_prepared(prepared, start, stop, imm, on_done, on_error, on_unposted)

    def _queue_prepared(
        self,
        prepared: PreparedWrites,
        start: int,
        stop: int,
        imm: int | None,
        on_done: Callable[[], None] | None,
        on_error: ErrorCallback | None,
        on_unposted: UnpostedCallback | None,
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

    def _queue_write(
        self,
        src: MemoryRegionHandle,
        peer: PeerHandle,
        dst: MemoryRegionDescriptor,
        arrays: tuple[IntPointer, IntPointer, IntPointer],
        keep_alive: object,
        num_ops: int,
        num_bytes: int,
        imm: int | None,
        on_done: Callable[[], None] | None,
        on_error: ErrorCallback | None,
        on_unposted: UnpostedCallback | None,
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

    # -- messages -------------------------------------------------------------------------------

    def send(
        self,
        peer: PeerHandle,
        payload: bytes,
        on_done: Callable[[], None] | None,
        on_error: ErrorCallback | None,
    ) -> None:
        """`TransferEngine.submit_send`."""
        self.check_open()
        self._peers.check(peer)
        if len(payload) > self._max_message_bytes:
            raise MessageTooLargeError(
                f"message of {len(payload)} bytes exceeds "
                f"max_message_bytes={self._max_message_bytes}"
            )
        job = Job(
            job_id=self._loop.new_job_id(),
            kind=SEND,
            peer=peer,
            total=1,
            deadline=time.monotonic() + self.op_timeout,
            on_done=on_done,
            on_error=on_error,
            payload=MessagePools.frame(self._address, bytes(payload)),
        )
        self._loop.enqueue(job, self.submit_timeout)
