"""Ray placement of one worker: a placement group of one bundle per TP rank, ``STRICT_PACK``.

A group that can never be satisfied (a bundle larger than any node, more GPUs than the cluster
has) stays pending forever in Ray; `place_worker` waits at most ``timeout_seconds`` and then
raises `PlacementError` naming what was asked and what the cluster has. Once a worker has
started, `check_reachable` refuses the settings that only work on one node when the workers
have landed on several.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from orchestrator.config.cluster import ClusterConfig
from orchestrator.control.registry import WorkerRecord
from workers.netaddr import is_loopback

logger = logging.getLogger(__name__)


class PlacementError(RuntimeError):
    """A worker's placement group did not become ready in time, or its node cannot work with
    the others'."""


def worker_bundles(bundle: dict[str, float], tp_size: int) -> list[dict[str, float]]:
    """The bundles of one worker of ``tp_size`` ranks of ``bundle`` each; the worker's actor
    (the TP leader, which spawns the other ranks as its own processes) runs in the first.

    One bundle per rank, except for GPU ranks under tensor parallelism: Ray makes visible to an
    actor only the GPUs of its own bundle, and the leader's followers need theirs, so those
    ranks' resources form a single bundle (``STRICT_PACK`` keeps it on one node either way).
    """
    if tp_size > 1 and bundle.get("GPU", 0) > 0:
        return [{key: value * tp_size for key, value in bundle.items()}]
    return [dict(bundle) for _ in range(tp_size)]


async def place_worker(
    name: str, bundles: list[dict[str, float]], timeout_seconds: float
) -> PlacementGroup:
    """A ready ``STRICT_PACK`` placement group of ``bundles`` (`worker_bundles`)."""
    group = placement_group(bundles, strategy="STRICT_PACK", name=name)
    try:
        await asyncio.wait_for(group.ready(), timeout_seconds)
    except BaseException as error:
        # Timed out, or the caller gave up (cancelled: a stopped start, the app shutting
        # down): a group left pending would be placed later and hold its resources for good.
        remove_worker_placement(group)
        if not isinstance(error, TimeoutError):
            raise
        raise PlacementError(
            f"{name}: placement group of {bundles} (STRICT_PACK) not ready after "
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


def check_reachable(
    config: ClusterConfig, started: WorkerRecord, workers: Iterable[WorkerRecord]
) -> None:
    """Raise `PlacementError` when ``started`` runs on another node than some of ``workers``
    and the config holds what only works on one node: a loopback ``worker_host`` (the router
    could not dial the workers), a loopback ``fabric.node`` or ``fabric.nics`` entry or the
    ``shm`` provider (KV could not cross)."""
    others = {w.node_ip for w in workers if w.node_ip and w.worker_id != started.worker_id}
    if not others - {started.node_ip}:
        return
    problems = []
    if config.worker_host is not None and is_loopback(config.worker_host):
        problems.append(
            f"worker_host {config.worker_host} is loopback: the router cannot dial workers on "
            "other nodes (null: each worker's node IP)"
        )
    for group in config.groups:
        fabric = group.fabric
        if fabric is None:
            continue
        path = f"groups.{group.role}.fabric"
        if fabric.provider == "shm":
            problems.append(f"{path}.provider shm moves KV within one node only")
        if fabric.node is not None and is_loopback(fabric.node):
            problems.append(
                f"{path}.node {fabric.node} is loopback: KV cannot reach other nodes (null: "
                "each worker's node IP)"
            )
        loopback = [nic for nic in fabric.nic_entries if is_loopback(nic) or nic == "lo"]
        if loopback:
            problems.append(
                f"{path}.nics: {', '.join(loopback)} on loopback: KV cannot reach other nodes"
            )
    if problems:
        raise PlacementError(
            f"{started.worker_id} landed on node {started.node_ip}, other workers on "
            f"{', '.join(sorted(others))}: " + "; ".join(problems)
        )
