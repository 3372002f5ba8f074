"""Simulate transfer plans on real per-rank pools and compare bytes with the global KV."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from workers.fabric import MemoryRegionDescriptor
from workers.kv.errors import ShardingError
from workers.kv.pages import sendable_pages
from workers.kv.pools import layout_from_descriptor
from workers.kv.sharding import (
    GroupSharding,
    PageGeometry,
    PageSpan,
    TransferPlan,
    make_transfer_plan,
)
from workers.kv.writes import (
    PoolLayout,
    expected_write_count,
    expected_write_count_from_dst,
    expected_writes_by_dst_rank,
    plan_layer_writes,
)

GEOMETRY = PageGeometry(num_layers=2, page_size=4, head_dim=3, element_size=2)
NUM_SRC_PAGES = 14
NUM_DST_PAGES = 12
POWERS = (1, 2, 4, 8)
# (src_pages, dst_pages): one long run, gaps on either side, a reversed list, a single page.
PAGE_LISTS = (
    ([2, 3, 4, 5, 6], [5, 6, 7, 8, 9]),
    ([0, 1, 2, 7, 8, 11], [3, 4, 9, 10, 11, 0]),
    ([9, 10, 11, 12], [1, 2, 4, 5]),
    ([13, 12, 11], [0, 1, 2]),
    ([4], [7]),
)


def rank_heads(sharding: GroupSharding, rank: int) -> slice:
    start = sharding.head_start(rank)
    return slice(start, start + sharding.heads_per_rank)


def make_global_kv(num_heads: int, seed: int, planes: int = 2) -> np.ndarray:
    """Every head's KV of every source page; ``planes`` 1: MLA's latent, no V."""
    shape = (
        GEOMETRY.num_layers,
        NUM_SRC_PAGES,
        planes,
        num_heads,
        GEOMETRY.page_size,
        GEOMETRY.head_dim,
    )
    # Random 16-bit patterns (not floats) so every bit of every element is checked.
    return np.random.default_rng(seed).integers(0, 1 << 16, size=shape, dtype=np.uint16)


def simulate(
    plan: TransferPlan,
    global_kv: np.ndarray,
    src_pages: list[int],
    dst_pages: list[int],
    segments: list[range] | None = None,
) -> tuple[list[np.ndarray], int]:
    """Apply the planned writes as byte copies; return destination pools and write count."""
    src_pools = [
        np.ascontiguousarray(global_kv[:, :, :, rank_heads(plan.src, r)])
        for r in range(plan.src.tp_size)
    ]
    dst_layout = PoolLayout.for_group(plan.dst, GEOMETRY, NUM_DST_PAGES)
    src_layout = PoolLayout.for_group(plan.src, GEOMETRY, NUM_SRC_PAGES)
    shape = (GEOMETRY.num_layers, NUM_DST_PAGES, plan.dst.kv_planes, plan.dst.heads_per_rank, 4, 3)
    dst_pools = [np.zeros(shape, np.uint16) for _ in range(plan.dst.tp_size)]
    assert all(pool.nbytes == dst_layout.num_bytes for pool in dst_pools)
    src_bytes = [pool.reshape(-1).view(np.uint8) for pool in src_pools]
    dst_bytes = [pool.reshape(-1).view(np.uint8) for pool in dst_pools]
    num_writes = 0
    for layer in range(GEOMETRY.num_layers):
        for part in segments or [range(len(src_pages))]:
            writes = plan_layer_writes(
                plan,
                layer,
                src_pages[part.start : part.stop],
                dst_pages[part.start : part.stop],
                src_layout,
                dst_layout,
                first_page_index=part.start,
            )
            for w in writes:
                dst = dst_bytes[w.dst_rank][w.dst_offset : w.dst_offset + w.length]
                src = src_bytes[w.src_rank][w.src_offset : w.src_offset + w.length]
                assert len(dst) == len(src) == w.length
                dst[:] = src
            num_writes += len(writes)
    return dst_pools, num_writes


def assert_destination_matches(
    plan: TransferPlan,
    global_kv: np.ndarray,
    src_pages: list[int],
    dst_pages: list[int],
    dst_pools: list[np.ndarray],
) -> None:
    for rank, pool in enumerate(dst_pools):
        expected = np.zeros_like(pool)
        expected[:, dst_pages] = global_kv[:, src_pages][:, :, :, rank_heads(plan.dst, rank)]
        np.testing.assert_array_equal(pool, expected)


def valid_combos() -> list[tuple[int, int, int, bool]]:
    return [
        (heads, p, d, mla)
        for heads, p, d in itertools.product(POWERS, POWERS, POWERS)
        for mla in (False, True)
        if not mla or heads <= 2  # MLA: one latent "head" (2 to check multi-head copies)
    ]


@pytest.mark.parametrize(("num_heads", "src_tp", "dst_tp", "is_mla"), valid_combos())
def test_plan_reconstructs_destination_bit_exact(
    num_heads: int, src_tp: int, dst_tp: int, is_mla: bool
) -> None:
    src = GroupSharding(src_tp, num_heads, is_mla)
    dst = GroupSharding(dst_tp, num_heads, is_mla)
    global_kv = make_global_kv(
        num_heads, seed=num_heads * 100 + src_tp * 10 + dst_tp, planes=src.kv_planes
    )
    rng = random.Random(src_tp * 7 + dst_tp)
    for src_pages, dst_pages in PAGE_LISTS:
        plan = make_transfer_plan(src, dst, GEOMETRY, rng=rng)
        dst_pools, num_writes = simulate(plan, global_kv, src_pages, dst_pages)
        assert_destination_matches(plan, global_kv, src_pages, dst_pages, dst_pools)
        expected = expected_write_count(plan, src_pages, dst_pages, GEOMETRY.num_layers, 3)
        assert num_writes == expected - 3


def test_same_tp_whole_pages_coalesce_into_runs() -> None:
    plan = make_transfer_plan(
        GroupSharding(4, 8), GroupSharding(4, 8), GEOMETRY, rng=random.Random(0)
    )
    assert plan.coalescable and plan.writes_per_page == 4
    assert [(s.src_rank, s.dst_rank) for s in plan.shards] == [(r, r) for r in range(4)]
    src, dst = [0, 1, 2, 7, 8, 11], [3, 4, 9, 10, 11, 0]  # runs: [0-1], [2], [7-8], [11]
    assert expected_write_count(plan, src, dst, 2, 1) == 2 * 4 * 4 + 1
    assert expected_writes_by_dst_rank(plan, src, dst, 2) == dict.fromkeys(range(4), 8)


@pytest.mark.parametrize(("src_tp", "dst_tp", "num_shards"), [(4, 2, 4), (2, 4, 4), (8, 1, 8)])
def test_split_or_reconstructed_pages_take_two_writes_per_page(
    src_tp: int, dst_tp: int, num_shards: int
) -> None:
    plan = make_transfer_plan(
        GroupSharding(src_tp, 8), GroupSharding(dst_tp, 8), GEOMETRY, rng=random.Random(0)
    )
    assert not plan.coalescable
    assert len(plan.shards) == num_shards and plan.writes_per_page == 2 * num_shards
    pages = list(range(5))  # contiguous, yet K/V halves of a head range never coalesce
    assert expected_write_count(plan, pages, pages, 2, 0) == 2 * 5 * 2 * num_shards


def test_replicated_heads_use_one_source_set_per_destination_set() -> None:
    # H=2: prefill TP 8 has 4 replica sets {0,4}, {1,5}, {2,6}, {3,7}; decode TP 4 has 2.
    src, dst = GroupSharding(8, 2), GroupSharding(4, 2)
    assert src.num_replica_sets == 4 and [src.head_start(r) for r in range(8)] == [
        0,
        0,
        0,
        0,
        1,
        1,
        1,
        1,
    ]
    plan = make_transfer_plan(src, dst, GEOMETRY, source_sets=[3, 1])
    assert [(s.src_rank, s.dst_rank, s.num_heads) for s in plan.shards] == [
        (3, 0, 1),
        (1, 1, 1),
        (7, 2, 1),
        (5, 3, 1),
    ]
    assert plan.coalescable


@pytest.mark.parametrize(
    ("heads", "src_tp", "dst_tp", "is_mla"), [(2, 8, 2, False), (1, 4, 2, False), (1, 4, 4, True)]
)
def test_random_source_choice_covers_every_source_rank(
    heads: int, src_tp: int, dst_tp: int, is_mla: bool
) -> None:
    src, dst = GroupSharding(src_tp, heads, is_mla), GroupSharding(dst_tp, heads, is_mla)
    rng = random.Random(1234)
    used: set[int] = set()
    for _ in range(64):
        plan = make_transfer_plan(src, dst, GEOMETRY, rng=rng)
        used.update(s.src_rank for s in plan.shards)
        if is_mla:  # one source rank per destination rank, all of them when dst_tp >= src_tp
            assert [s.dst_rank for s in plan.shards] == list(range(dst_tp))
            assert len({s.src_rank for s in plan.shards}) == min(src_tp, dst_tp)
    assert used == set(range(src_tp))


def test_within_one_request_destination_sets_spread_over_source_sets() -> None:
    plan = make_transfer_plan(
        GroupSharding(4, 1), GroupSharding(4, 1), GEOMETRY, rng=random.Random(5)
    )
    assert sorted(plan.source_sets) == [0, 1, 2, 3]


def test_chunked_segments_give_the_same_count_and_bytes() -> None:
    src_pages = [0, 1, 2, 3, 4, 5, 6, 9, 10, 11]
    dst_pages = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    plan = make_transfer_plan(
        GroupSharding(2, 4), GroupSharding(2, 4), GEOMETRY, rng=random.Random(0), segment_pages=3
    )
    global_kv = make_global_kv(4, seed=9)
    # A chunk schedule that finished pages 0..4, then 5..8, then 9: send what is sendable.
    segments: list[range] = []
    sent = 0
    for done in (5, 9, 10):
        part = sendable_pages(done, len(src_pages), sent, plan.segment_pages)
        segments.append(part)
        sent = part.stop
    assert segments == [range(0, 3), range(3, 9), range(9, 10)]
    pools, num_writes = simulate(plan, global_kv, src_pages, dst_pages, segments)
    assert_destination_matches(plan, global_kv, src_pages, dst_pages, pools)
    # Runs cut at page indices 3, 6, 9 plus the src gap at index 7: [0-2] [3-5] [6] [7-8] [9].
    assert num_writes == expected_write_count(plan, src_pages, dst_pages, 2, 0) == 2 * 2 * 5


def test_max_pages_per_run_limits_every_write() -> None:
    plan = make_transfer_plan(
        GroupSharding(1, 2),
        GroupSharding(1, 2),
        GEOMETRY,
        rng=random.Random(0),
        max_pages_per_run=2,
    )
    src_pages, dst_pages = [0, 1, 2, 3, 4, 8], [2, 3, 4, 5, 6, 7]
    pools, num_writes = simulate(plan, make_global_kv(2, seed=3), src_pages, dst_pages)
    assert_destination_matches(plan, make_global_kv(2, seed=3), src_pages, dst_pages, pools)
    assert num_writes == expected_write_count(plan, src_pages, dst_pages, 2, 0) == 2 * 4
    layout = PoolLayout.for_group(plan.src, GEOMETRY, NUM_SRC_PAGES)
    writes = plan_layer_writes(plan, 1, src_pages, dst_pages, layout, layout)
    assert max(w.length for w in writes) == 2 * layout.page_bytes


def test_per_rank_page_lists() -> None:
    plan = make_transfer_plan(
        GroupSharding(2, 2), GroupSharding(2, 2), GEOMETRY, rng=random.Random(0)
    )
    src = {0: [0, 1, 2], 1: [5, 6, 8]}
    dst = {0: [0, 1, 2], 1: [0, 1, 2]}
    assert expected_writes_by_dst_rank(plan, src, dst, 2) == {0: 2, 1: 4}


def test_coalescing_can_be_turned_off() -> None:
    plan = make_transfer_plan(
        GroupSharding(1, 1),
        GroupSharding(1, 1),
        GEOMETRY,
        rng=random.Random(0),
        coalesce_pages=False,
    )
    assert not plan.coalescable
    assert expected_write_count(plan, [0, 1, 2], [4, 5, 6], 2, 1) == 7
    assert expected_write_count_from_dst(plan, [4, 5, 6], 2, 1) == 7


def test_decoder_side_count_needs_no_source_pages_only_without_coalescing() -> None:
    split = make_transfer_plan(
        GroupSharding(4, 4), GroupSharding(2, 4), GEOMETRY, rng=random.Random(0)
    )
    assert expected_write_count_from_dst(split, [3, 4], 2, 0) == expected_write_count(
        split, [9, 1], [3, 4], 2, 0
    )
    whole = make_transfer_plan(
        GroupSharding(2, 4), GroupSharding(2, 4), GEOMETRY, rng=random.Random(0)
    )
    with pytest.raises(ShardingError, match="prefill's page ids"):
        expected_write_count_from_dst(whole, [3, 4], 2, 0)


def test_mismatched_inputs_are_rejected() -> None:
    rng = random.Random(0)
    with pytest.raises(ShardingError, match="disagree"):
        make_transfer_plan(GroupSharding(2, 4), GroupSharding(2, 8), GEOMETRY, rng=rng)
    with pytest.raises(ShardingError, match="source_sets"):
        make_transfer_plan(GroupSharding(4, 2), GroupSharding(2, 2), GEOMETRY, source_sets=[2])
    with pytest.raises(ShardingError, match="rng or source_sets"):
        make_transfer_plan(GroupSharding(2, 2), GroupSharding(2, 2), GEOMETRY)
    plan = make_transfer_plan(GroupSharding(2, 2), GroupSharding(2, 2), GEOMETRY, rng=rng)
    layout = PoolLayout.for_group(plan.src, GEOMETRY, 4)
    wrong = PoolLayout.for_group(GroupSharding(1, 2), GEOMETRY, 4)
    with pytest.raises(ShardingError, match="does not match"):
        plan_layer_writes(plan, 0, [0], [0], layout, wrong)
    with pytest.raises(ShardingError, match="outside pool"):
        plan_layer_writes(plan, 0, [3, 4], [0, 1], layout, layout)
    with pytest.raises(ShardingError, match="repeat"):
        expected_write_count(plan, [1, 1], [0, 1], 2, 0)
    with pytest.raises(ShardingError, match="num_layers"):
        expected_write_count(plan, [1], [0], 3, 0)


# --- MLA: one latent plane per page, the same on every rank ------------------------------------

MLA_PAIRS = [(1, 1), (2, 1), (1, 2), (2, 2), (2, 4)]


@pytest.mark.parametrize(("src_tp", "dst_tp"), MLA_PAIRS)
def test_mla_plan_sends_each_destination_rank_whole_pages_from_one_source(
    src_tp: int, dst_tp: int
) -> None:
    src, dst = GroupSharding(src_tp, 1, is_mla=True), GroupSharding(dst_tp, 1, is_mla=True)
    assert src.kv_planes == dst.kv_planes == 1
    plan = make_transfer_plan(src, dst, GEOMETRY, rng=random.Random(src_tp * 10 + dst_tp))
    # source_sets[k]: the source rank of destination rank k.
    assert len(plan.source_sets) == dst_tp and all(0 <= s < src_tp for s in plan.source_sets)
    assert [(s.src_rank, s.dst_rank) for s in plan.shards] == [
        (plan.source_sets[rank], rank) for rank in range(dst_tp)
    ]
    page_bytes = GEOMETRY.head_bytes  # one plane of one latent "head"
    assert plan.spans == ((PageSpan(0, 0, page_bytes),),) * dst_tp
    assert plan.coalescable and plan.writes_per_page == dst_tp
    # Dealt round-robin from a shuffle: balanced within the request.
    counts = [plan.source_sets.count(rank) for rank in range(src_tp)]
    assert max(counts) - min(counts) <= 1
    # The decoder rebuilds the same plan from the source sets the request carries.
    again = make_transfer_plan(src, dst, GEOMETRY, source_sets=plan.source_sets)
    assert again.shards == plan.shards and again.spans == plan.spans
    src_pages, dst_pages = [0, 1, 2, 7, 8, 11], [3, 4, 9, 10, 11, 0]  # 4 runs
    assert expected_write_count(plan, src_pages, dst_pages, 2, 1) == 2 * 4 * dst_tp + 1
    global_kv = make_global_kv(1, seed=src_tp * 10 + dst_tp, planes=1)
    pools, num_writes = simulate(plan, global_kv, src_pages, dst_pages)
    assert_destination_matches(plan, global_kv, src_pages, dst_pages, pools)
    assert num_writes == 2 * 4 * dst_tp


@pytest.mark.parametrize(("src_tp", "dst_tp"), MLA_PAIRS)
def test_mla_every_source_rank_is_chosen_across_requests(src_tp: int, dst_tp: int) -> None:
    src, dst = GroupSharding(src_tp, 1, is_mla=True), GroupSharding(dst_tp, 1, is_mla=True)
    rng = random.Random(99)
    chosen: dict[int, set[int]] = {rank: set() for rank in range(dst_tp)}
    for _ in range(64):
        plan = make_transfer_plan(src, dst, GEOMETRY, rng=rng)
        for shard in plan.shards:
            chosen[shard.dst_rank].add(shard.src_rank)
    assert all(sources == set(range(src_tp)) for sources in chosen.values())


def test_mla_source_sets_need_one_entry_per_destination_rank() -> None:
    src, dst = GroupSharding(2, 1, is_mla=True), GroupSharding(4, 1, is_mla=True)
    with pytest.raises(ShardingError, match="4 values in \\[0, 2\\)"):
        make_transfer_plan(src, dst, GEOMETRY, source_sets=[1])
    with pytest.raises(ShardingError, match="source_sets"):
        make_transfer_plan(src, dst, GEOMETRY, source_sets=[0, 1, 2, 0])


def test_pool_layout_has_one_plane_under_mla() -> None:
    mla, dense = GroupSharding(2, 1, is_mla=True), GroupSharding(2, 1)
    layout = PoolLayout.for_group(mla, GEOMETRY, NUM_DST_PAGES)
    assert layout.kv_planes == 1 and dense.kv_planes == 2
    assert layout.page_bytes == 1 * 1 * 4 * 3 * 2
    assert PoolLayout.for_group(dense, GEOMETRY, NUM_DST_PAGES).page_bytes == 2 * layout.page_bytes
    assert layout.num_bytes == GEOMETRY.num_layers * NUM_DST_PAGES * layout.page_bytes
    assert layout.page_offset(1, 2) == (NUM_DST_PAGES + 2) * layout.page_bytes
    assert layout.matches(mla, GEOMETRY) and not layout.matches(dense, GEOMETRY)
    with pytest.raises(ShardingError, match="kv_planes"):
        PoolLayout(2, 4, 1, 4, 3, 2, kv_planes=3)


@pytest.mark.parametrize("is_mla", [True, False])
def test_layout_from_descriptor_round_trip(is_mla: bool) -> None:
    sharding = GroupSharding(2, 1, is_mla)
    layout = PoolLayout.for_group(sharding, GEOMETRY, NUM_DST_PAGES)
    descriptor = MemoryRegionDescriptor("tcp;ofi_rxm", 0, layout.num_bytes, 1, False)
    assert layout_from_descriptor(descriptor, sharding, GEOMETRY) == layout
    # A length that is no whole number of all-layer pages is refused.
    odd = MemoryRegionDescriptor("tcp;ofi_rxm", 0, layout.num_bytes + layout.page_bytes, 1, False)
    with pytest.raises(ShardingError, match="whole number"):
        layout_from_descriptor(odd, sharding, GEOMETRY)
