"""The decoder's context buffer: one registered row per transfer slot, into which the prefill
worker writes the hidden state of the request's last prefilled position (its last write).

A row is the hidden state in the engine's dtype, then, in checksum mode, room for the sums of
every shard (`workers.kv.checksum`), 8-aligned. When a transfer's counter fired the row is
complete: `ContextRows.verify` recomputes the sums over the pages that were received and
`hidden_state` copies the state out before the slot is reused.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from workers.engine.engine_core import EngineCore
from workers.fabric import TransferEngine
from workers.kv.checksum import area_bytes, byte_view, max_shards, verify
from workers.kv.sharding import GroupSharding, TransferPlan
from workers.kv.writes import PoolLayout


class ContextRows:
    def __init__(
        self,
        fabric: TransferEngine,
        engine: EngineCore,
        sharding: GroupSharding,
        layout: PoolLayout,
        max_transfers: int,
        *,
        checksum: bool,
        rank_pools: Sequence[object] | None,
    ) -> None:
        """``rank_pools``: every rank's KV pool (default: the engine's own), read as bytes by
        checksum mode."""
        self._dtype = engine.dtype
        self._layout = layout
        element_size = torch.empty((), dtype=engine.dtype).element_size()
        self.hidden_bytes = engine.model_config.hidden_size * element_size
        self.row_bytes = self.hidden_bytes
        self._pool_views: list[np.ndarray] = []
        if checksum:
            self.row_bytes += area_bytes(max_shards(sharding))
            self.row_bytes = -(-self.row_bytes // 8) * 8
            self._pool_views = [byte_view(pool) for pool in rank_pools or [engine.kv_cache]]
        self.buffer = torch.zeros(max_transfers, self.row_bytes, dtype=torch.uint8)
        _, self.descriptor = fabric.register(self.buffer)

    def offset(self, slot: int) -> int:
        """Where the slot's row starts in the registered buffer."""
        return slot * self.row_bytes

    def verify(self, plan: TransferPlan, page_ids: Sequence[int], slot: int) -> None:
        """Raises `KVChecksumError` when the received pages differ from the prefill's sums."""
        row = self.buffer[slot].numpy()
        verify(
            plan,
            list(page_ids),
            self._pool_views,
            self._layout,
            row[: self.hidden_bytes],
            row[self.hidden_bytes :],
        )

    def hidden_state(self, slot: int) -> torch.Tensor:
        """A copy of the slot's hidden state, in the engine's dtype."""
        return self.buffer[slot, : self.hidden_bytes].clone().view(self._dtype)
