"""fi_getinfo wrapper: what a provider offers here, and picking NICs by proximity.

`query_fabric` returns one `FabricInfo` per fi_info entry (one per NIC/domain for hardware
providers). `select_nics` orders NICs for a buffer that lives near a NUMA node or a PCI device
(e.g. a GPU): same NUMA node first, then nearest PCI bus, then fastest link. The engine opens
one domain; a rank with several NICs opens one engine per NIC chosen this way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from workers.fabric._lib import ffi, lib, strerror
from workers.fabric.errors import FabricUnavailableError

if TYPE_CHECKING:
    from workers.fabric._fabric_cffi import CharArray, FiInfo, PdInfo

# Short names accepted for convenience; libfabric wants the layered name for RDM over MSG.
PROVIDER_ALIASES = {"tcp": "tcp;ofi_rxm", "verbs": "verbs;ofi_rxm"}


@dataclass(frozen=True)
class FabricInfo:
    provider: str
    fabric: str
    domain: str
    caps: int
    mode: int
    mr_mode: int
    cq_data_size: int
    max_msg_size: int
    inject_size: int
    tx_size: int
    rx_size: int
    manual_progress: bool
    nic_name: str | None
    pci_address: str | None
    link_speed: int
    numa_node: int | None

    @property
    def hmem(self) -> bool:
        """Registers device (GPU) memory: FI_HMEM."""
        return bool(self.caps & lib.FI_HMEM)

    @property
    def imm_bits(self) -> int:
        """Usable width of immediate data (FI_REMOTE_CQ_DATA), capped at 64."""
        return min(64, 8 * self.cq_data_size)


def normalize_provider(provider: str) -> str:
    return PROVIDER_ALIASES.get(provider, provider)


@contextlib.contextmanager
def fi_info_list(provider: str, node: str | None, want_hmem: bool = False) -> Iterator[FiInfo]:
    """The raw fi_info list for our hints; freed on exit."""
    out = ffi.new("struct fi_info **")
    node_arg = node.encode() if node else ffi.NULL
    rc = lib.pd_getinfo(
        normalize_provider(provider).encode(), node_arg, ffi.NULL, int(want_hmem), out
    )
    if rc != 0:
        hmem = " + FI_HMEM (device memory registration)" if want_hmem else ""
        raise FabricUnavailableError(
            f"provider {provider!r} (node {node!r}) offers no RDM endpoint with FI_RMA + "
            f"FI_MSG{hmem} and remote CQ data here: fi_getinfo: {strerror(rc)} ({rc})"
        )
    try:
        yield out[0]
    finally:
        lib.pd_freeinfo(out[0])


def describe(info_list: FiInfo) -> list[FabricInfo]:
    described: list[FabricInfo] = []
    raw = ffi.new("pd_info_t *")
    for index in range(lib.pd_info_count(info_list)):
        lib.pd_info_describe(info_list, index, raw)
        described.append(_to_fabric_info(raw))
    return described


def query_fabric(provider: str, node: str | None = None) -> list[FabricInfo]:
    with fi_info_list(provider, node) as info_list:
        return describe(info_list)


def _text(chars: CharArray) -> str:
    return ffi.string(chars).decode(errors="replace")


def _to_fabric_info(raw: PdInfo) -> FabricInfo:
    pci = None
    if raw.has_nic and raw.bus_type == lib.FI_BUS_PCI:
        pci = f"{raw.pci_domain:04x}:{raw.pci_bus:02x}:{raw.pci_device:02x}.{raw.pci_function:x}"
    return FabricInfo(
        provider=_text(raw.prov_name),
        fabric=_text(raw.fabric_name),
        domain=_text(raw.domain_name),
        caps=int(raw.caps),
        mode=int(raw.mode),
        mr_mode=int(raw.mr_mode),
        cq_data_size=int(raw.cq_data_size),
        max_msg_size=int(raw.max_msg_size),
        inject_size=int(raw.inject_size),
        tx_size=int(raw.tx_size),
        rx_size=int(raw.rx_size),
        manual_progress=raw.data_progress == lib.FI_PROGRESS_MANUAL,
        nic_name=_text(raw.nic_name) or None if raw.has_nic else None,
        pci_address=pci,
        link_speed=int(raw.link_speed),
        numa_node=pci_numa_node(pci) if pci else None,
    )


def pci_numa_node(pci_address: str, sysfs: Path = Path("/sys/bus/pci/devices")) -> int | None:
    """NUMA node of a PCI device from sysfs (None when unknown or -1)."""
    try:
        node = int((sysfs / pci_address / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def _pci_bus_distance(a: str, b: str) -> int:
    # Same domain and bus is closest; otherwise the bus number difference approximates the
    # switch hierarchy well enough to break ties among NICs on one socket.
    domain_a, bus_a = a.split(":")[:2]
    domain_b, bus_b = b.split(":")[:2]
    if domain_a != domain_b:
        return 1 << 16
    return abs(int(bus_a, 16) - int(bus_b, 16))


def select_nics(
    infos: Sequence[FabricInfo],
    numa_node: int | None = None,
    near_pci: str | None = None,
    count: int = 1,
) -> list[FabricInfo]:
    """The `count` best entries for memory near `numa_node` / the PCI device `near_pci`."""
    if near_pci is not None and numa_node is None:
        numa_node = pci_numa_node(near_pci)

    def rank(info: FabricInfo) -> tuple[int, int, int]:
        numa_miss = 0 if numa_node is None or info.numa_node in (None, numa_node) else 1
        if info.numa_node is None and numa_node is not None:
            numa_miss = 1
        distance = (
            _pci_bus_distance(info.pci_address, near_pci)
            if near_pci is not None and info.pci_address is not None
            else 1 << 17
        )
        return numa_miss, distance, -info.link_speed

    return sorted(infos, key=rank)[:count]
