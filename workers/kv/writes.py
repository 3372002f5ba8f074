"""The concrete RDMA writes of a `TransferPlan`, and how many the decoder must count.

The prefill messenger posts exactly the `Write`s of `plan_layer_writes` (each with the request's
imm); the decoder arms its counter with `expected_write_count`. Both derive from the same plan
and the same run rule (`workers.kv.pages.coalesce_page_runs`), so they agree by construction:

    expected = num_layers * sum over shards of
                   (number of runs        if the shard moves whole pages and coalescing is on
                    spans * number of pages  otherwise; spans = 1 whole page, 2 = K and V)
               + context_writes

where runs follow the plan's ``segment_pages`` cuts and ``max_pages_per_run`` limit.

Every destination rank's writes are counted under the one imm of the request: the decode
group's single transfer engine (on its leader) registers every rank's KV pool.

Page ids are rank-symmetric (one list for every rank of a group, the engine's page table) or a
mapping ``rank -> list`` where a group's ranks allocate independently.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from workers.kv.errors import ShardingError
from workers.kv.pages import coalesce_page_runs
from workers.kv.sharding import GroupSharding, PageGeometry, TransferPlan

PageIds = Sequence[int] | Mapping[int, Sequence[int]]


@dataclass(frozen=True)
class PoolLayout:
    """Byte layout of one rank's KV pool ``[num_layers, num_pages, kv_planes, kv_heads_local,
    page_size, head_dim]`` (C-contiguous). Offsets are relative to the pool's first byte.
    ``kv_planes``: K and V (2), or MLA's single latent (1)."""

    num_layers: int
    num_pages: int
    kv_heads_local: int
    page_size: int
    head_dim: int
    element_size: int
    kv_planes: int = 2

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_pages", "kv_heads_local", "page_size", "head_dim"):
            if getattr(self, name) < 1:
                raise ShardingError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.element_size < 1:
            raise ShardingError(f"element_size must be >= 1, got {self.element_size}")
        if self.kv_planes not in (1, 2):
            raise ShardingError(f"kv_planes must be 1 or 2, got {self.kv_planes}")

    @classmethod
    def for_group(
        cls, sharding: GroupSharding, geometry: PageGeometry, num_pages: int
    ) -> PoolLayout:
        return cls(
            geometry.num_layers,
            num_pages,
            sharding.heads_per_rank,
            geometry.page_size,
            geometry.head_dim,
            geometry.element_size,
            sharding.kv_planes,
        )

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer: every plane of every local head."""
        heads = self.kv_planes * self.kv_heads_local
        return heads * self.page_size * self.head_dim * self.element_size

    @property
    def num_bytes(self) -> int:
        return self.num_layers * self.num_pages * self.page_bytes

    def page_offset(self, layer: int, page: int) -> int:
        if not (0 <= layer < self.num_layers and 0 <= page < self.num_pages):
            raise ShardingError(
                f"(layer {layer}, page {page}) outside pool of {self.num_layers} layers x "
                f"{self.num_pages} pages"
            )
        return (layer * self.num_pages + page) * self.page_bytes

    def matches(self, sharding: GroupSharding, geometry: PageGeometry) -> bool:
        return (
            self.kv_heads_local == sharding.heads_per_rank
            and self.kv_planes == sharding.kv_planes
            and self.num_layers == geometry.num_layers
            and self.page_size == geometry.page_size
            and self.head_dim == geometry.head_dim
            and self.element_size == geometry.element_size
        )


@dataclass(frozen=True)
class Write:
    """One one-sided write: ``length`` bytes from ``src_offset`` of source rank ``src_rank``'s
    pool to ``dst_offset`` of destination rank ``dst_rank``'s pool."""

    src_rank: int
    dst_rank: int
    src_offset: int
    dst_offset: int
    length: int


def pages_of_rank(pages: PageIds, rank: int) -> Sequence[int]:
    if isinstance(pages, Mapping):
        if rank not in pages:
            raise ShardingError(f"no page list for rank {rank}")
        return pages[rank]
    return pages


def expected_write_count(
    plan: TransferPlan,
    src_pages: PageIds,
    dst_pages: PageIds,
    num_layers: int,
    context_writes: int,
) -> int:
    """Writes carrying the request's imm that the decoder must count before the KV is ready."""
    return sum(expected_writes_by_dst_rank(plan, src_pages, dst_pages, num_layers).values()) + (
        _check_context_writes(context_writes)
    )


def expected_write_count_from_dst(
    plan: TransferPlan, dst_pages: PageIds, num_layers: int, context_writes: int
) -> int:
    """The count as the decoder can know it before the prefill side allocated its pages.

    Only defined when no shard coalesces (coalescing off, or every page split in K/V parts):
    then the count depends on the number of pages alone. Otherwise the runs depend on the
    prefill's page ids and the decoder must take the count from `PrefillAccepted`.
    """
    if any(plan.shard_coalescable(i) for i in range(len(plan.shards))):
        raise ShardingError("with coalescing the count depends on the prefill's page ids")
    # Same-length stand-in source lists: without coalescing only their length matters.
    return expected_write_count(plan, dst_pages, dst_pages, num_layers, context_writes)


def expected_writes_by_dst_rank(
    plan: TransferPlan, src_pages: PageIds, dst_pages: PageIds, num_layers: int
) -> dict[int, int]:
    """KV writes landing on each destination rank (diagnostics; the counter sees the sum)."""
    if not 0 < num_layers <= plan.geometry.num_layers:
        raise ShardingError(
            f"num_layers must be in [1, {plan.geometry.num_layers}], got {num_layers}"
        )
    counts: Counter[int] = Counter({rank: 0 for rank in range(plan.dst.tp_size)})
    for index, shard in enumerate(plan.shards):
        src, dst = _checked_pages(
            pages_of_rank(src_pages, shard.src_rank), pages_of_rank(dst_pages, shard.dst_rank)
        )
        if plan.shard_coalescable(index):
            per_layer = len(_runs(plan, src, dst, 0))
        else:
            per_layer = len(plan.spans[index]) * len(dst)
        counts[shard.dst_rank] += num_layers * per_layer
    return dict(counts)


def plan_layer_writes(
    plan: TransferPlan,
    layer: int,
    src_pages: PageIds,
    dst_pages: PageIds,
    src_layout: PoolLayout,
    dst_layout: PoolLayout,
    *,
    first_page_index: int = 0,
) -> list[Write]:
    """The writes moving ``layer`` of the given pages, in shard order.

    For chunked prefill pass the slice of the request's page lists that is ready, with
    ``first_page_index`` its index in the request; slices must start on a segment boundary and
    end on one or at the request's last page (`workers.kv.pages.sendable_pages`), otherwise the
    runs -- and so the count -- would differ from the decoder's.
    """
    if not src_layout.matches(plan.src, plan.geometry):
        raise ShardingError(f"source pool {src_layout} does not match the plan")
    if not dst_layout.matches(plan.dst, plan.geometry):
        raise ShardingError(f"destination pool {dst_layout} does not match the plan")
    if plan.segment_pages is not None and first_page_index % plan.segment_pages != 0:
        raise ShardingError(
            f"first_page_index {first_page_index} is not on a {plan.segment_pages}-page segment"
        )
    writes: list[Write] = []
    for index, shard in enumerate(plan.shards):
        src, dst = _checked_pages(
            pages_of_rank(src_pages, shard.src_rank), pages_of_rank(dst_pages, shard.dst_rank)
        )
        if plan.shard_coalescable(index):
            for src_start, dst_start, length in _runs(plan, src, dst, first_page_index):
                # Validate the run's last page too: the write must stay inside both pools.
                src_layout.page_offset(layer, src_start + length - 1)
                dst_layout.page_offset(layer, dst_start + length - 1)
                writes.append(
                    Write(
                        shard.src_rank,
                        shard.dst_rank,
                        src_layout.page_offset(layer, src_start),
                        dst_layout.page_offset(layer, dst_start),
                        length * src_layout.page_bytes,
                    )
                )
            continue
        for src_page, dst_page in zip(src, dst, strict=True):
            src_base = src_layout.page_offset(layer, src_page)
            dst_base = dst_layout.page_offset(layer, dst_page)
            writes.extend(
                Write(
                    shard.src_rank,
                    shard.dst_rank,
                    src_base + span.src_offset,
                    dst_base + span.dst_offset,
                    span.length,
                )
                for span in plan.spans[index]
            )
    return writes


def _runs(
    plan: TransferPlan, src: Sequence[int], dst: Sequence[int], first_page_index: int
) -> list[tuple[int, int, int]]:
    return coalesce_page_runs(
        src,
        dst,
        segment_pages=plan.segment_pages,
        first_page_index=first_page_index,
        max_pages_per_run=plan.max_pages_per_run,
    )


def _checked_pages(src: Sequence[int], dst: Sequence[int]) -> tuple[Sequence[int], Sequence[int]]:
    # A repeated page id would make two writes land on (or read from) the same page: a bug in
    # the caller's allocation that must fail the request instead of corrupting KV silently.
    if len(src) != len(dst):
        raise ShardingError(f"page lists differ in length: {len(src)} != {len(dst)}")
    if len(set(src)) != len(src) or len(set(dst)) != len(dst):
        raise ShardingError("page lists must not repeat a page id")
    if any(page < 0 for page in src) or any(page < 0 for page in dst):
        raise ShardingError("page ids must be >= 0")
    return src, dst


def _check_context_writes(context_writes: int) -> int:
    if context_writes < 0:
        raise ShardingError(f"context_writes must be >= 0, got {context_writes}")
    return context_writes
