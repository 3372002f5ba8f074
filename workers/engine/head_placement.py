"""Which KV heads each rank of a tensor-parallel group holds (vLLM's placement rule).

For a model with ``H`` KV heads split over a group of TP size ``tp``:

- ``tp <= H`` (sharded): rank ``r`` holds heads ``[r * H/tp, (r + 1) * H/tp)``; needs
  ``H % tp == 0``.
- ``tp > H`` (replicated): each head lives on ``tp/H`` *consecutive* ranks, rank ``r`` holds head
  ``r // (tp/H)``; needs ``tp % H == 0``.
- MLA-style (``is_mla``): every rank holds the identical KV of all ``H`` heads (in practice one
  latent "head"), in one plane per head instead of K and V (`GroupSharding.kv_planes`).

A *replica set* is a set of ranks that together hold every head exactly once: replica set ``k``
is the ranks ``{h * tp/H + k}`` (one per head) when replicated, the whole group when sharded, and
every single rank under MLA. A group has ``max(1, tp/H)`` replica sets (``tp`` under MLA).

The engine shards its attention by this rule (`workers.engine.parallel`); the KV transfer plans
(`workers.kv.sharding`) map one group's placement onto another's with the same object, so a
transfer moves exactly the heads each rank computes.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.engine.errors import HeadPlacementError


@dataclass(frozen=True)
class GroupSharding:
    """KV head placement of one TP group; `HeadPlacementError` if the heads do not fit."""

    tp_size: int
    num_kv_heads: int
    is_mla: bool = False

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.num_kv_heads < 1:
            raise HeadPlacementError(
                f"tp_size and num_kv_heads must be >= 1, got {self.tp_size}, {self.num_kv_heads}"
            )
        if self.is_mla:
            return
        if self.num_kv_heads % self.tp_size != 0 and self.tp_size % self.num_kv_heads != 0:
            raise HeadPlacementError(
                f"TP size {self.tp_size} must divide or be a multiple of the "
                f"{self.num_kv_heads} KV heads"
            )

    @property
    def kv_planes(self) -> int:
        """Planes of a KV page: K and V (2), or MLA's single latent (1)."""
        return 1 if self.is_mla else 2

    @property
    def heads_per_rank(self) -> int:
        if self.is_mla:
            return self.num_kv_heads
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def num_replica_sets(self) -> int:
        """How many ranks hold each head (equivalently, how many full copies of the KV)."""
        if self.is_mla:
            return self.tp_size
        return max(1, self.tp_size // self.num_kv_heads)

    @property
    def replica_set_size(self) -> int:
        return self.tp_size // self.num_replica_sets

    def head_start(self, rank: int) -> int:
        """First (global) KV head held by ``rank``."""
        self._check_rank(rank)
        if self.is_mla:
            return 0
        return (rank // self.num_replica_sets) * self.heads_per_rank

    def rank_of(self, position: int, replica_set: int) -> int:
        """Rank at ``position`` (head-range index) inside ``replica_set``."""
        if not (0 <= position < self.replica_set_size and 0 <= replica_set < self.num_replica_sets):
            raise HeadPlacementError(f"no rank at position {position} of replica set {replica_set}")
        return position * self.num_replica_sets + replica_set

    def replica_set_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank % self.num_replica_sets

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.tp_size:
            raise HeadPlacementError(f"rank {rank} outside TP group of size {self.tp_size}")
