"""What a prefill worker is, fixed when its messenger starts.

The engine and fabric it serves with (one transfer engine per NIC, the primary first:
`workers.fabric.nics`), its group's KV layout with every rank's pool registered with each of
them, the size of one hidden state, and this registration's incarnation. Built once
(`PrefillSide.wire`); the request checks (`workers.kv.prefill_checks`) and the messenger read it,
and nothing in it changes while the worker serves.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from workers.engine.engine_core import EngineCore
from workers.fabric import TransferEngine
from workers.kv.checksum import byte_view
from workers.kv.errors import KvTransferError
from workers.kv.pools import RegisteredPools, register_engine_pools, register_extra_nics
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
    # The engines of the rank's other NICs (writes only; they share ``fabric``'s counters) and
    # every rank's pool registered with each, in the same order.
    extra_nics: tuple[TransferEngine, ...] = ()
    extra_pools: tuple[RegisteredPools, ...] = ()

    @property
    def checksum_capable(self) -> bool:
        return bool(self.src_views)

    @property
    def nics(self) -> tuple[TransferEngine, ...]:
        """Every NIC's engine, the primary (``fabric``) first: a write's NIC index."""
        return (self.fabric, *self.extra_nics)

    @contextlib.contextmanager
    def wakes_deferred(self) -> Iterator[None]:
        """`TransferEngine.wakes_deferred` on every NIC's engine."""
        with contextlib.ExitStack() as stack:
            for nic in self.nics:
                stack.enter_context(nic.wakes_deferred())
            yield

    @classmethod
    def wire(
        cls,
        engine: EngineCore,
        fabric: TransferEngine,
        rank_pools: Sequence[object] | None,
        sharding: GroupSharding | None,
        extra_nics: Sequence[TransferEngine] = (),
    ) -> PrefillSide:
        """Register every rank's pool (default: the engine's own) with ``fabric`` and each of
        ``extra_nics`` (`register_extra_nics`)."""
        sharding, geometry, pools = register_engine_pools(fabric, engine, rank_pools, sharding)
        extra_pools = register_extra_nics(
            fabric, extra_nics, rank_pools or [engine.kv_cache], pools.layout
        )
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
            extra_nics=tuple(extra_nics),
            extra_pools=extra_pools,
        )
