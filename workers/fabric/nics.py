"""Several NICs per rank: one `TransferEngine` per NIC, all counting into one set of counters.

A `TransferEngine` is one libfabric domain and endpoint, so every write it posts leaves through
the one NIC its address is on. A rank with several NICs opens one engine on each
(`NicSet.open`); a transfer's writes may then leave through any of them and land on any of the
peer's. Which engine carries which writes is the caller's choice (the KV messenger picks one
NIC pair per request: `workers.kv.nic_lanes`).

- **The primary** (the first entry) is the rank's engine as peers know it: its address is the
  one advertised (a prefill worker's `PrefillEndpoint`, the source of every control message),
  and control messages go through it alone. The others carry one-sided writes only.
- **One count per imm.** Every engine of the set shares the primary's `ImmCounters`
  (`TransferEngine(counters=...)`), so a counter armed once counts the writes carrying its value
  on whichever NIC they land; deadlines and surplus rules are the counters' own
  (`workers.fabric.counters`). `ProgressStats.imm_writes_received` tells each NIC's share.
- **Lost as a whole.** When any engine of the set ends (closed, abandoned by its watchdog, its
  progress thread died) the shared counters close, and so every engine's `closed_reason` says
  why: writes routed through the lost NIC could never be counted, so the rank reports its
  fabric unusable and is replaced, as with one NIC.

Entries (`resolve_nic`) are interface names (their IPv4 address, else their first global IPv6
one) or addresses of this host; anything else raises `NicError` naming the entry. They are
resolved on the host that opens the engines: a cluster config is loaded on another one.
``shm`` has no NIC to choose (it moves bytes through the host's memory): a set of several
entries on it is refused.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import ipaddress
import socket
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from workers.fabric.engine import EngineStats, TransferEngine
from workers.fabric.errors import NicError
from workers.fabric.providers import normalize_provider

_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address
_IFNAMSIZ = 16  # linux/if.h, with its terminating NUL
_IF_INET6 = Path("/proc/net/if_inet6")


def interface_names() -> list[str]:
    """The network interfaces of this host."""
    return sorted(name for _, name in socket.if_nameindex())


def interface_address(name: str) -> str | None:
    """The address an engine on interface ``name`` binds: its IPv4 address, else its first
    global IPv6 one (a link-local one needs a scope the provider's node name cannot carry);
    None when it has neither."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        request = struct.pack("256s", name.encode()[: _IFNAMSIZ - 1])
        try:
            answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            return socket.inet_ntoa(answer[20:24])  # struct ifreq: name, then sockaddr_in
        except OSError:
            pass  # no IPv4 address (EADDRNOTAVAIL)
    try:
        lines = _IF_INET6.read_text().splitlines()
    except OSError:
        return None
    for line in lines:  # address, index, prefix length, scope, flags, name
        fields = line.split()
        if len(fields) == 6 and fields[5] == name and fields[3] == "00":  # global scope
            return str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
    return None


def is_local_address(address: str) -> bool:
    """``address`` (an IP literal) is one of this host's: a socket can bind it."""
    ip = ipaddress.ip_address(address)
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError as error:
            if error.errno in (errno.EADDRNOTAVAIL, errno.EINVAL):
                return False
            raise
    return not ip.is_unspecified


def resolve_nic(entry: str) -> str:
    """The address to open an engine on for ``entry``: an interface of this host (its address)
    or an address of this host (itself); `NicError` otherwise."""
    try:
        literal = ipaddress.ip_address(entry)
    except ValueError:
        literal = None
    names = interface_names()
    if literal is not None:
        if is_local_address(entry):
            return str(literal)
        raise NicError(
            f"NIC {entry!r} is not an address of this host ({socket.gethostname()}; its "
            f"interfaces: {', '.join(names)})"
        )
    if entry in names:
        address = interface_address(entry)
        if address is None:
            raise NicError(f"NIC {entry!r}: the interface has no IPv4 or global IPv6 address")
        return address
    raise NicError(
        f"NIC {entry!r} is neither an interface of this host ({socket.gethostname()}: "
        f"{', '.join(names)}) nor one of its addresses"
    )


class NicSet:
    """A rank's transfer engines, one per NIC; ``engines[0]`` is the primary (module doc)."""

    def __init__(self, engines: Sequence[TransferEngine]) -> None:
        if not engines:
            raise ValueError("a NIC set needs at least one engine")
        primary = engines[0]
        for engine in engines[1:]:
            if engine.counters is not primary.counters:
                raise ValueError("the engines of a NIC set must share the primary's counters")
            if engine.provider != primary.provider:
                raise ValueError(f"NICs on {engine.provider} and {primary.provider}")
        self.engines: tuple[TransferEngine, ...] = tuple(engines)

    @classmethod
    def open(cls, provider: str, nics: Sequence[str], **options: Any) -> NicSet:
        """One engine per entry of ``nics`` (`resolve_nic`), in order, the first the primary;
        ``options``: `TransferEngine`'s keyword arguments, the same for each."""
        if not nics:
            raise ValueError("no NIC given")
        if normalize_provider(provider) == "shm" and len(nics) > 1:
            raise ValueError(
                f"shm moves KV through this host's memory, not a NIC: {len(nics)} NICs given"
            )
        addresses = [resolve_nic(entry) for entry in nics]
        for index, address in enumerate(addresses):
            if address in addresses[:index]:
                first = addresses.index(address)
                raise NicError(
                    f"NICs {nics[first]!r} and {nics[index]!r} are both {address}: one engine "
                    "per NIC"
                )
        engines: list[TransferEngine] = []
        try:
            for address in addresses:
                counters = engines[0].counters if engines else None  # the primary's, shared
                engines.append(TransferEngine(provider, address, counters=counters, **options))
        except BaseException:
            for engine in reversed(engines):
                engine.close()
            raise
        return cls(engines)

    @property
    def primary(self) -> TransferEngine:
        return self.engines[0]

    @property
    def extra(self) -> tuple[TransferEngine, ...]:
        """The engines after the primary: writes only."""
        return self.engines[1:]

    @property
    def addresses(self) -> tuple[bytes, ...]:
        return tuple(engine.address for engine in self.engines)

    def closed_reason(self) -> str | None:
        """Why the set takes no more work (any engine's reason; module doc), None while all
        work."""
        for engine in self.engines:
            reason = engine.closed_reason()
            if reason is not None:
                return reason
        return None

    @contextlib.contextmanager
    def wakes_deferred(self) -> Iterator[None]:
        """`TransferEngine.wakes_deferred` on every engine of the set."""
        with contextlib.ExitStack() as stack:
            for engine in self.engines:
                stack.enter_context(engine.wakes_deferred())
            yield

    def stats(self) -> tuple[EngineStats, ...]:
        """Each engine's stats, in NIC order (their ``imm`` is the one shared set)."""
        return tuple(engine.stats() for engine in self.engines)

    def close(self, timeout: float = 10.0) -> None:
        """Close every engine, the primary last (it carries the control messages)."""
        for engine in reversed(self.engines):
            engine.close(timeout)
