"""KV head placement over the ranks of one tensor-parallel group."""

from __future__ import annotations

import pytest

from workers.engine.errors import HeadPlacementError
from workers.engine.head_placement import GroupSharding


@pytest.mark.parametrize(("tp", "heads"), [(4, 6), (2, 3), (3, 2), (0, 2)])
def test_indivisible_head_counts_are_rejected(tp: int, heads: int) -> None:
    with pytest.raises(HeadPlacementError):
        GroupSharding(tp, heads)


def test_sharded_replicated_and_mla_groups_place_heads_by_rank() -> None:
    sharded = GroupSharding(4, 8)
    assert sharded.heads_per_rank == 2 and sharded.num_replica_sets == 1
    assert [sharded.head_start(rank) for rank in range(4)] == [0, 2, 4, 6]
    # Two heads over eight ranks: each head on four consecutive ranks.
    replicated = GroupSharding(8, 2)
    assert replicated.heads_per_rank == 1 and replicated.num_replica_sets == 4
    assert [replicated.head_start(rank) for rank in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [replicated.rank_of(position, 3) for position in range(2)] == [3, 7]
    mla = GroupSharding(4, 1, is_mla=True)
    assert mla.heads_per_rank == 1 and mla.num_replica_sets == 4
    assert {mla.head_start(rank) for rank in range(4)} == {0}
    # A page holds K and V, or MLA's single latent.
    assert (sharded.kv_planes, replicated.kv_planes, mla.kv_planes) == (2, 2, 1)


def test_ranks_outside_the_group_are_rejected() -> None:
    with pytest.raises(HeadPlacementError, match="outside"):
        GroupSharding(2, 4).head_start(2)
