"""pdserve data plane: libfabric one-sided writes with immediate data (see README.md).

Public surface: `TransferEngine` (writes, immediate counters, messages), the handles and
descriptors it hands out, the page-run rule shared by both ends of a KV transfer, NIC
discovery, `NicSet` (one engine per NIC of a rank, one count), and the `FabricError` family.
"""

from __future__ import annotations

from workers.fabric.counters import ImmStats
from workers.fabric.descriptors import MemoryRegionDescriptor
from workers.fabric.engine import EngineStats, PreparedWrites, TransferEngine
from workers.fabric.errors import (
    AddressError,
    DescriptorError,
    EngineClosedError,
    FabricError,
    FabricUnavailableError,
    ImmError,
    ImmTimeoutError,
    MessageTooLargeError,
    NicError,
    OperationTimeoutError,
    OutOfRangeError,
    PeerFailedError,
    PeerStuckError,
    ProviderError,
    RegistrationError,
    SubmitQueueFullError,
    TransferError,
)
from workers.fabric.handles import MemoryRegionHandle, PeerHandle
from workers.fabric.jobs import ProgressStats
from workers.fabric.messages import Message
from workers.fabric.nics import NicSet, resolve_nic
from workers.fabric.paging import can_coalesce, coalesce_page_runs, count_paged_write_runs
from workers.fabric.providers import FabricInfo, query_fabric, select_nics

__all__ = [
    "AddressError",
    "DescriptorError",
    "EngineClosedError",
    "EngineStats",
    "FabricError",
    "FabricInfo",
    "FabricUnavailableError",
    "ImmError",
    "ImmStats",
    "ImmTimeoutError",
    "MemoryRegionDescriptor",
    "MemoryRegionHandle",
    "Message",
    "MessageTooLargeError",
    "NicError",
    "NicSet",
    "OperationTimeoutError",
    "OutOfRangeError",
    "PeerFailedError",
    "PeerHandle",
    "PeerStuckError",
    "PreparedWrites",
    "ProgressStats",
    "ProviderError",
    "RegistrationError",
    "SubmitQueueFullError",
    "TransferEngine",
    "TransferError",
    "can_coalesce",
    "coalesce_page_runs",
    "count_paged_write_runs",
    "query_fabric",
    "resolve_nic",
    "select_nics",
]
