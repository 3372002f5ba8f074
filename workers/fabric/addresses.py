"""The engine's peers by address: one `PeerHandle` per address, however threads race.

`add` checks an address on the caller's thread, then inserts it into the address vector on the
progress thread (`ProgressLoop.call`); the handle's life there (failures, retirement, AV
removal) is the loop's `PeerTable`. `forget` drops the address here and retires its handle.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from workers.fabric._lib import ffi, lib, strerror
from workers.fabric.errors import AddressError, FabricError
from workers.fabric.handles import PeerHandle
from workers.fabric.messages import MAX_ADDRESS_BYTES

if TYPE_CHECKING:
    from workers.fabric._fabric_cffi import PdEngine
    from workers.fabric.progress import ProgressLoop

log = logging.getLogger(__name__)

_SHM_DIR = Path("/dev/shm")


class PeerDirectory:
    def __init__(
        self, native: PdEngine, own_address: bytes, provider: str, loop: ProgressLoop
    ) -> None:
        self._native = native
        self._own = own_address
        self._provider = provider
        self._loop = loop
        self._peers: dict[bytes, PeerHandle] = {}
        self._lock = threading.Lock()

    def add(self, address: bytes) -> PeerHandle:
        """The handle of ``address``, inserted on first use (`TransferEngine.add_peer`)."""
        address = bytes(address)
        known = self._peers.get(address)  # the common case, without waiting for the lock
        if known is not None:
            return known
        with self._lock:
            known = self._peers.get(address)
            if known is not None:
                return known
            self._check_address(address)
            peer: PeerHandle = self._loop.call(lambda: self._insert(address))
            self._peers[address] = peer
            return peer

    def forget(self, address: bytes) -> None:
        """Drop ``address``; its handle is retired (`TransferEngine.forget_peer`)."""
        with self._lock:
            peer = self._peers.pop(bytes(address), None)
            if peer is not None:
                self._loop.call(lambda: self._loop.peers.retire(peer))

    def failure(self, address: bytes) -> FabricError | None:
        """Why the peer at ``address`` failed (None: it has not, or is unknown)."""
        peer = self._peers.get(bytes(address))
        if peer is None:
            return None
        return self._loop.peers.failure(peer.fi_addr)

    def check(self, peer: PeerHandle) -> None:
        """Raise unless ``peer`` is the current handle of its address here."""
        if self._peers.get(peer.address) is not peer:
            raise AddressError(f"peer {peer.name} was not added to this engine")

    def _check_address(self, address: bytes) -> None:
        own = self._own
        if not address or len(address) > MAX_ADDRESS_BYTES:
            raise AddressError(f"peer address of {len(address)} bytes")
        scheme = own.split(b"://", 1)[0] + b"://" if b"://" in own else None
        if scheme is not None and not address.startswith(scheme):
            raise AddressError(f"not a {self._provider} address: {address[:32]!r}")
        # Binary (sockaddr) formats: same length and address family as ours.
        if scheme is None and (len(address) != len(own) or address[:2] != own[:2]):
            raise AddressError(
                f"not a {self._provider} address: {len(address)} bytes {address[:16].hex()}"
            )
        if self._provider == "shm":
            # shm accepts any name into its AV and silently reuses the slot when no such
            # region exists; refuse names with no region on this host up front.
            name = address[len(scheme or b"") :].rstrip(b"\0").decode(errors="replace")
            if "/" in name or not (_SHM_DIR / name).exists():
                raise AddressError(f"no shm endpoint {name!r} on this host (peer not running?)")

    def _insert(self, address: bytes) -> PeerHandle:
        """On the progress thread, under `_lock`: the handle for ``address``."""
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
