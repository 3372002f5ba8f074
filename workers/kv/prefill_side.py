"""What a prefill worker is, fixed when its messenger starts.

The engine and fabric it serves with, its group's KV layout with every rank's pool registered,
the size of one hidden state, and this registration's incarnation. Built once
(`PrefillSide.wire`); the request checks (`workers.kv.prefill_checks`) and the messenger read it,
and nothing in it changes while the worker serves.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from workers.engine.engine_core import EngineCore
from workers.fabric import TransferEngine
from workers.kv.checksum import byte_view
from workers.kv.errors import KvTransferError
from workers.kv.pools import RegisteredPools, register_engine_pools
from workers.kv.sharding import GroupSharding, PageGeometry


@dataclass(frozen=True)
class PrefillSide:
    engine: EngineCore
    fabric: TransferEngine
    sharding: GroupSharding
    geometry: PageGeometry
    pools: RegisteredPools
    # This registration's id (`PrefillEndpoint.incarnation`): a restarted worker draws anew.
    incarnation: int
    hidden_bytes: int  # one hidden state in the engine's dtype
    # Each rank's pool as host bytes, which checksum mode reads; empty for device pools.
    src_views: tuple[np.ndarray, ...]

    @property
    def checksum_capable(self) -> bool:
        return bool(self.src_views)

    @classmethod
    def wire(
        cls,
        engine: EngineCore,
        fabric: TransferEngine,
        rank_pools: Sequence[object] | None,
        sharding: GroupSharding | None,
    ) -> PrefillSide:
        """Register every rank's pool (default: the engine's own) with ``fabric``."""
        sharding, geometry, pools = register_engine_pools(fabric, engine, rank_pools, sharding)
        element_size = torch.empty((), dtype=engine.dtype).element_size()
        try:  # checksum mode reads the source pools as bytes (host memory only)
            src_views = tuple(byte_view(pool) for pool in rank_pools or [engine.kv_cache])
        except KvTransferError:
            src_views = ()
        return cls(
            engine,
            fabric,
            sharding,
            geometry,
            pools,
            incarnation=random.SystemRandom().getrandbits(64) or 1,
            hidden_bytes=engine.model_config.hidden_size * element_size,
            src_views=src_views,
        )
