"""Which KV heads each prefill rank writes to which decode rank (tensor parallelism).

Where the heads live in one TP group is the engine's rule (`workers.engine.head_placement`,
re-exported here as `GroupSharding`): ranges of ``H/tp`` heads when ``tp <= H``, each head on
``tp/H`` consecutive ranks when ``tp > H``, every head on every rank under MLA; a *replica set*
is a set of ranks that together hold every head once. A layout that does not fit raises the
engine's `HeadPlacementError`; everything this module rejects is a `ShardingError`.

A transfer plan maps every destination replica set onto one source replica set -- chosen by a
seeded ``random.Random`` (shuffled, then dealt round-robin) so that across requests every source
rank initiates writes -- and, inside each pair, intersects the head ranges of source and
destination positions. Under MLA every rank is a replica set holding the whole latent, so each
destination rank gets its pages from one source rank of its own, drawn the same way (with
``dst_tp >= src_tp`` every source rank sends). The result, a tuple of `ShardWrite`, is the same
for every page and layer of the request.

Byte consequence of the ``[planes, kv_heads_local, page_size, head_dim]`` page (planes K and V,
or MLA's one latent: `GroupSharding.kv_planes`): a head range is contiguous only within one
plane. A shard that covers the whole page on both sides moves in one write (and adjacent pages
coalesce); any other shard takes one write per plane per page, K and V (MLA's shards always
cover the whole page).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from workers.engine.errors import HeadPlacementError
from workers.engine.head_placement import GroupSharding
from workers.kv.errors import ShardingError

__all__ = [
    "GroupSharding",
    "HeadPlacementError",
    "PageGeometry",
    "PageSpan",
    "ShardWrite",
    "TransferPlan",
    "make_transfer_plan",
]


@dataclass(frozen=True)
class PageGeometry:
    """Per-rank page shape shared by both groups (same model, same cache config)."""

    num_layers: int
    page_size: int
    head_dim: int
    element_size: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "page_size", "head_dim", "element_size"):
            if getattr(self, name) < 1:
                raise ShardingError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one plane (K, V or the latent) of one page:
        ``[page_size, head_dim]``."""
        return self.page_size * self.head_dim * self.element_size


@dataclass(frozen=True)
class ShardWrite:
    """Heads ``[src_head_start, +num_heads)`` of a source rank's page land at local heads
    ``[dst_head_start, +num_heads)`` of the same page index on a destination rank (local head
    indices, i.e. relative to each rank's first head)."""

    src_rank: int
    dst_rank: int
    src_head_start: int
    dst_head_start: int
    num_heads: int

    def __post_init__(self) -> None:
        if min(self.src_rank, self.dst_rank, self.src_head_start, self.dst_head_start) < 0:
            raise ShardingError(f"negative field in {self}")
        if self.num_heads < 1:
            raise ShardingError(f"num_heads must be >= 1 in {self}")


@dataclass(frozen=True)
class PageSpan:
    """One write's byte range relative to the start of a page (same length on both sides)."""

    src_offset: int
    dst_offset: int
    length: int


@dataclass(frozen=True)
class TransferPlan:
    """Everything both sides need to derive the same writes for one request.

    ``source_sets[k]`` is the source replica set sending to destination replica set ``k``; under
    MLA, where every rank is a replica set, the source rank sending to destination rank ``k``
    (``dst.tp_size`` entries in ``[0, src.tp_size)``). ``spans[i]`` are the byte ranges of one
    page that ``shards[i]`` moves: one span (whole page) or one per plane (K part, V part).
    ``coalesce_pages``, ``segment_pages`` and ``max_pages_per_run`` parameterize the run rule
    of `workers.kv.pages`; both sides must use the same values (they travel in the request).
    """

    src: GroupSharding
    dst: GroupSharding
    geometry: PageGeometry
    source_sets: tuple[int, ...]
    shards: tuple[ShardWrite, ...]
    spans: tuple[tuple[PageSpan, ...], ...]
    coalesce_pages: bool = True
    segment_pages: int | None = None
    max_pages_per_run: int | None = None

    def __post_init__(self) -> None:
        if len(self.spans) != len(self.shards):
            raise ShardingError("one span tuple per shard is required")
        for name in ("segment_pages", "max_pages_per_run"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ShardingError(f"{name} must be >= 1 or None, got {value}")

    @property
    def writes_per_page(self) -> int:
        """Writes per page per layer summed over shards, before any coalescing."""
        return sum(len(spans) for spans in self.spans)

    @property
    def coalescable(self) -> bool:
        """Whether adjacent pages merge into one write (every shard moves whole pages)."""
        return self.coalesce_pages and all(len(spans) == 1 for spans in self.spans)

    def shard_coalescable(self, index: int) -> bool:
        return self.coalesce_pages and len(self.spans[index]) == 1


def make_transfer_plan(
    src: GroupSharding,
    dst: GroupSharding,
    geometry: PageGeometry,
    *,
    rng: random.Random | None = None,
    source_sets: Sequence[int] | None = None,
    coalesce_pages: bool = True,
    segment_pages: int | None = None,
    max_pages_per_run: int | None = None,
) -> TransferPlan:
    """Plan one request's transfer. Give either ``rng`` (the choosing side) or the
    ``source_sets`` it chose (the side that received them in the `PrefillRequest`)."""
    if (src.num_kv_heads, src.is_mla) != (dst.num_kv_heads, dst.is_mla):
        raise ShardingError(f"prefill {src} and decode {dst} disagree on the KV heads")
    chosen = _source_sets(src, dst, rng, source_sets)
    shards = _shards(src, dst, chosen)
    spans = tuple(_page_spans(src, dst, geometry, shard) for shard in shards)
    return TransferPlan(
        src, dst, geometry, chosen, shards, spans, coalesce_pages, segment_pages, max_pages_per_run
    )


def _source_sets(
    src: GroupSharding,
    dst: GroupSharding,
    rng: random.Random | None,
    given: Sequence[int] | None,
) -> tuple[int, ...]:
    # One source set per destination set; under MLA (every rank a set) one source rank per
    # destination rank.
    num_choices, num_picks = src.num_replica_sets, dst.num_replica_sets
    if given is not None:
        chosen = tuple(given)
        if len(chosen) != num_picks or not all(0 <= s < num_choices for s in chosen):
            raise ShardingError(
                f"source_sets {chosen} must be {num_picks} values in [0, {num_choices})"
            )
        return chosen
    if rng is None:
        raise ShardingError("make_transfer_plan needs rng or source_sets")
    # Shuffle, then deal round-robin: random across requests, balanced within one.
    order = list(range(num_choices))
    rng.shuffle(order)
    return tuple(order[k % num_choices] for k in range(num_picks))


def _shards(
    src: GroupSharding, dst: GroupSharding, source_sets: tuple[int, ...]
) -> tuple[ShardWrite, ...]:
    # Under MLA a replica set is one rank holding every head: the intersection below is then one
    # whole-page shard from source rank ``source_sets[k]`` to destination rank ``k``.
    src_heads, dst_heads = src.heads_per_rank, dst.heads_per_rank
    shards: list[ShardWrite] = []
    for dst_set, src_set in enumerate(source_sets):
        for dst_pos in range(dst.replica_set_size):
            dst_begin = dst_pos * dst_heads
            for src_pos in range(src.replica_set_size):
                src_begin = src_pos * src_heads
                begin = max(src_begin, dst_begin)
                end = min(src_begin + src_heads, dst_begin + dst_heads)
                if begin >= end:
                    continue
                shards.append(
                    ShardWrite(
                        src.rank_of(src_pos, src_set),
                        dst.rank_of(dst_pos, dst_set),
                        begin - src_begin,
                        begin - dst_begin,
                        end - begin,
                    )
                )
    shards.sort(key=lambda s: (s.dst_rank, s.dst_head_start))
    return tuple(shards)


def _page_spans(
    src: GroupSharding, dst: GroupSharding, geometry: PageGeometry, shard: ShardWrite
) -> tuple[PageSpan, ...]:
    head_bytes = geometry.head_bytes
    planes = src.kv_planes  # equal on both sides: make_transfer_plan checked is_mla
    src_plane = src.heads_per_rank * head_bytes  # bytes of one plane (K, V) of a source page
    dst_plane = dst.heads_per_rank * head_bytes
    if shard.num_heads == src.heads_per_rank == dst.heads_per_rank:
        return (PageSpan(0, 0, planes * src_plane),)
    src_at = shard.src_head_start * head_bytes
    dst_at = shard.dst_head_start * head_bytes
    length = shard.num_heads * head_bytes
    return tuple(
        PageSpan(plane * src_plane + src_at, plane * dst_plane + dst_at, length)
        for plane in range(planes)
    )
