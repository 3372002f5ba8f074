"""Ray placement of one worker: a placement group of one bundle per TP rank, ``STRICT_PACK``.

A group that can never be satisfied (a bundle larger than any node, more GPUs than the cluster
has) stays pending forever in Ray; `place_worker` waits at most ``timeout_seconds`` and then
raises `PlacementError` naming what was asked and what the cluster has.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

logger = logging.getLogger(__name__)


class PlacementError(RuntimeError):
    """A worker's placement group did not become ready in time."""


async def place_worker(
    name: str, bundle: dict[str, float], tp_size: int, timeout_seconds: float
) -> PlacementGroup:
    """A ready ``STRICT_PACK`` placement group of ``tp_size`` copies of ``bundle``."""
    group = placement_group(
        [dict(bundle) for _ in range(tp_size)], strategy="STRICT_PACK", name=name
    )
    try:
        await asyncio.wait_for(group.ready(), timeout_seconds)
    except TimeoutError:
        remove_placement_group(group)
        raise PlacementError(
            f"{name}: placement group of {tp_size} x {bundle} (STRICT_PACK) not ready after "
            f"{timeout_seconds:.0f} s; the cluster has {_resources()} in total and "
            f"{_available()} free. Lower groups.*.resources_per_rank or replicas, or add nodes."
        ) from None
    return group


def remove_worker_placement(group: PlacementGroup) -> None:
    try:
        remove_placement_group(group)
    except Exception:  # already gone with its cluster
        logger.debug("placement group removal failed", exc_info=True)


def _resources() -> dict[str, Any]:
    return {k: v for k, v in ray.cluster_resources().items() if not k.startswith("node:")}


def _available() -> dict[str, Any]:
    return {k: v for k, v in ray.available_resources().items() if not k.startswith("node:")}
