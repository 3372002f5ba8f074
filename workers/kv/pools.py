"""A TP group's KV pools as its leader's `TransferEngine` sees them (each engine, with one per NIC).

Each rank of a group owns one pool ``[num_layers, num_pages, kv_planes, kv_heads_local,
page_size, head_dim]`` (`workers.kv.writes.PoolLayout`; planes K and V, or MLA's one latent).
With tensor parallelism the other ranks' pools live in shared memory mapped into the leader
(CPU) or are imported device allocations (GPU), so the leader registers every rank's pool with
its one engine: rank ``r``'s writes use ``handles[r]`` as source, and peers write into rank
``r`` through ``descriptors[r]``. A leader with several NICs (`workers.fabric.nics`) registers
the same pools with each NIC's engine (`register_extra_nics`): a registration belongs to one
domain, and so do its keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.fabric import MemoryRegionDescriptor, MemoryRegionHandle, TransferEngine
from workers.kv.errors import ShardingError
from workers.kv.sharding import GroupSharding, PageGeometry
from workers.kv.writes import PoolLayout

if TYPE_CHECKING:
    from workers.engine.engine_core import EngineCore


def buffer_num_bytes(buffer: object) -> int:
    """Byte size of a torch tensor, numpy array or buffer-protocol object."""
    nbytes = getattr(buffer, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    numel = getattr(buffer, "numel", None)
    element_size = getattr(buffer, "element_size", None)
    if callable(numel) and callable(element_size):
        return int(numel()) * int(element_size())
    return memoryview(buffer).nbytes  # type: ignore[arg-type]


@dataclass(frozen=True)
class RegisteredPools:
    """Every rank's pool of one group, registered with the leader's engine."""

    layout: PoolLayout
    handles: tuple[MemoryRegionHandle, ...]
    descriptors: tuple[MemoryRegionDescriptor, ...]

    @property
    def tp_size(self) -> int:
        return len(self.handles)

    @classmethod
    def register(
        cls, engine: TransferEngine, buffers: Sequence[object], layout: PoolLayout
    ) -> RegisteredPools:
        """Register one pool per rank (rank order); each must have exactly the layout's size."""
        if not buffers:
            raise ShardingError("a group needs at least one rank's pool")
        for rank, buffer in enumerate(buffers):
            if buffer_num_bytes(buffer) != layout.num_bytes:
                raise ShardingError(
                    f"rank {rank}'s pool has {buffer_num_bytes(buffer)} bytes, the layout "
                    f"{layout} needs {layout.num_bytes}"
                )
        registered = [engine.register(buffer) for buffer in buffers]
        return cls(
            layout,
            tuple(handle for handle, _ in registered),
            tuple(descriptor for _, descriptor in registered),
        )

    def descriptor_bytes(self) -> tuple[bytes, ...]:
        return tuple(descriptor.to_bytes() for descriptor in self.descriptors)


def layout_from_descriptor(
    descriptor: MemoryRegionDescriptor, sharding: GroupSharding, geometry: PageGeometry
) -> PoolLayout:
    """The pool layout a peer rank's descriptor implies (its page count from its length)."""
    page_bytes = sharding.kv_planes * sharding.heads_per_rank * geometry.head_bytes
    pool_page_bytes = geometry.num_layers * page_bytes
    if descriptor.length % pool_page_bytes:
        raise ShardingError(
            f"descriptor of {descriptor.length} bytes is not a whole number of "
            f"{geometry.num_layers}-layer pages of {page_bytes} bytes"
        )
    return PoolLayout.for_group(sharding, geometry, descriptor.length // pool_page_bytes)


def register_engine_pools(
    fabric: TransferEngine,
    engine: EngineCore,
    rank_pools: Sequence[object] | None,
    sharding: GroupSharding | None,
) -> tuple[GroupSharding, PageGeometry, RegisteredPools]:
    """The group layout of ``engine`` (TP 1 unless ``sharding`` says otherwise) and every rank's
    pool registered with ``fabric``; ``rank_pools`` defaults to the engine's own pool."""
    model = engine.model_config
    sharding = sharding or GroupSharding(1, model.num_kv_heads, model.is_mla)
    if sharding.is_mla != model.is_mla:
        # The pools' plane count follows the model; a placement claiming otherwise would make
        # every page offset wrong.
        raise ShardingError(f"{sharding} does not match the model (is_mla={model.is_mla})")
    # Every layer of the pool, the MTP module's included (`workers.engine.mtp_drafter`).
    geometry = PageGeometry(
        engine.kv_layers, engine.config.page_size, model.head_dim, engine.kv_cache.element_size()
    )
    layout = PoolLayout.for_group(sharding, geometry, engine.num_pages)
    pools = RegisteredPools.register(fabric, rank_pools or [engine.kv_cache], layout)
    return sharding, geometry, pools


def register_extra_nics(
    fabric: TransferEngine,
    extra_nics: Sequence[TransferEngine],
    buffers: Sequence[object],
    layout: PoolLayout,
) -> tuple[RegisteredPools, ...]:
    """``buffers`` (every rank's pool, as registered with ``fabric``) registered with each of
    ``extra_nics``, the rank's other NICs. They must count into ``fabric``'s immediate
    counters (`workers.fabric.NicSet`): a request's writes may land on any of them, and the
    one counter armed for it must see them all."""
    for nic in extra_nics:
        if nic.counters is not fabric.counters:
            raise ValueError("a NIC's engine must share the primary engine's counters")
        if nic.provider != fabric.provider:
            raise ValueError(f"a NIC on {nic.provider}, the primary on {fabric.provider}")
    return tuple(RegisteredPools.register(nic, buffers, layout) for nic in extra_nics)
