"""Buffers of the two-sided control messages and their framing.

Frame: ``u16 source_len | source address | payload``. `tcp;ofi_rxm` cannot report a message's
source (no FI_SOURCE), so the sender's engine address travels in the frame; the receiver can
`add_peer(message.source)` to answer. Every engine posts `num_receives` receive buffers of
`frame_bytes` each and reposts a buffer as soon as its message is copied out; sends are copied
into one of `num_sends` registered bounce buffers (providers with FI_MR_LOCAL need registered
memory) that is released at the send's completion. A frame too short for its header or source
(a foreign or buggy sender) is dropped and counted (`ProgressStats.messages_malformed`); the
engine goes on.
"""

from __future__ import annotations

import logging
import queue
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from workers.fabric._lib import ffi, lib, strerror
from workers.fabric.callbacks import CallbackDispatcher
from workers.fabric.errors import EngineClosedError, FabricError, ProviderError

if TYPE_CHECKING:
    from workers.fabric._fabric_cffi import CData, PdEngine

log = logging.getLogger(__name__)

_LEN = struct.Struct("<H")
MAX_ADDRESS_BYTES = 256
RECEIVE_ID_BASE = 1 << 62
# Context slots beyond the receive buffers' that `max_inflight_ops` must leave for writes and
# sends: each posted receive holds one slot for the engine's life.
MIN_FREE_OP_SLOTS = 64


class Message(NamedTuple):
    """A received message: the sender engine's address and the payload."""

    source: bytes
    payload: bytes


class MessagePools:
    def __init__(self, max_payload: int, num_sends: int, num_receives: int) -> None:
        self.frame_bytes = _LEN.size + MAX_ADDRESS_BYTES + max_payload
        self._send = np.zeros(num_sends * self.frame_bytes, dtype=np.uint8)
        self._recv = np.zeros(num_receives * self.frame_bytes, dtype=np.uint8)
        self._send_lengths = [0] * num_sends
        self._free_sends = list(range(num_sends))
        self.num_sends = num_sends
        self._num_receives = num_receives
        self.send_desc: CData = ffi.NULL
        self._recv_desc: CData = ffi.NULL
        self._send_base = int(self._send.ctypes.data)
        self._recv_base = int(self._recv.ctypes.data)
        self.handler: Callable[[Message], None] | None = None
        self.inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()

    def register(self, register: Callable[[np.ndarray], CData]) -> None:
        """Register both pools with `register(array) -> desc` (the engine's MR path)."""
        self.send_desc = register(self._send)
        self._recv_desc = register(self._recv)

    @staticmethod
    def frame(source: bytes, payload: bytes) -> bytes:
        return _LEN.pack(len(source)) + source + payload

    def take_send_slot(self, frame: bytes) -> int:
        if not self._free_sends:
            return -1
        slot = self._free_sends.pop()
        start = slot * self.frame_bytes
        self._send[start : start + len(frame)] = np.frombuffer(frame, dtype=np.uint8)
        self._send_lengths[slot] = len(frame)
        return slot

    def send_buffer(self, slot: int) -> tuple[CData, int]:
        address = self._send_base + slot * self.frame_bytes
        return ffi.cast("void *", address), self._send_lengths[slot]

    def release_send_slot(self, slot: int) -> None:
        self._free_sends.append(slot)

    def is_receive(self, job_id: int) -> bool:
        return RECEIVE_ID_BASE <= job_id < RECEIVE_ID_BASE + self._num_receives

    def post_all_receives(self, native: PdEngine) -> None:
        for slot in range(self._num_receives):
            self.repost_receive(native, RECEIVE_ID_BASE + slot)

    def repost_receive(self, native: PdEngine, job_id: int) -> None:
        if not self.is_receive(job_id):  # any other id would post at a wild address
            raise FabricError(f"id {job_id:#x} is none of the {self._num_receives} receive buffers")
        slot = job_id - RECEIVE_ID_BASE
        address = ffi.cast("void *", self._recv_base + slot * self.frame_bytes)
        rc = lib.pd_post_recv(native, address, self.frame_bytes, self._recv_desc, job_id)
        if rc != 0:
            raise ProviderError(f"fi_recv failed: {strerror(rc)}", -rc)

    def deliver(
        self, native: PdEngine, job_id: int, length: int, dispatcher: CallbackDispatcher
    ) -> bool:
        """Hand the message in receive buffer ``job_id`` on and repost the buffer; False when
        the frame was malformed and dropped."""
        start = (job_id - RECEIVE_ID_BASE) * self.frame_bytes
        frame = self._recv[start : start + length].tobytes()
        self.repost_receive(native, job_id)
        # A sender's frame always holds its non-empty address (see `frame`).
        source_len = _LEN.unpack_from(frame)[0] if length >= _LEN.size else 0
        if not 0 < source_len <= min(MAX_ADDRESS_BYTES, length - _LEN.size):
            log.warning(
                "dropped a malformed message of %d bytes (source length %d)", length, source_len
            )
            return False
        message = Message(
            frame[_LEN.size : _LEN.size + source_len], frame[_LEN.size + source_len :]
        )
        handler = self.handler
        if handler is not None:
            try:
                dispatcher.submit(handler, message)
            except EngineClosedError:
                # Closed under a provider call that returned late (abandoned, then torn
                # down): nobody is left to hand the message to.
                log.debug("dropped a message that arrived after close")
        else:
            self.inbox.put(message)
        return True


def check_slots(max_inflight_ops: int, num_receive_buffers: int) -> None:
    """Refuse a context-slot pool that the receive buffers would leave (almost) empty."""
    if max_inflight_ops < num_receive_buffers + MIN_FREE_OP_SLOTS:
        raise ValueError(
            f"max_inflight_ops={max_inflight_ops} must exceed num_receive_buffers="
            f"{num_receive_buffers} by at least {MIN_FREE_OP_SLOTS}: every posted "
            f"receive buffer holds one of the max_inflight_ops operation contexts for good, "
            f"and writes and sends share the rest"
        )
