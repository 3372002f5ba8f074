"""Shutdown ends what the control plane started, replacements in progress included."""

from __future__ import annotations

import asyncio
from pathlib import Path

from orchestrator.config import ClusterConfig
from orchestrator.config_sections import GroupConfig
from orchestrator.controller import Controller
from orchestrator.registry import Registry, WorkerRecord


def test_shutdown_cancels_a_replacement_still_being_placed(tmp_path: Path) -> None:
    """A replacement waiting for its placement group when shutdown begins must not finish
    after it: it would start a worker nobody stops. Fake, named: `_launch` is replaced by one
    that waits forever, as a placement the cluster has no room for does."""
    config = ClusterConfig.from_dict(
        {"model": str(tmp_path / "absent"), "groups": {"mixed": {"replicas": 1}}}
    )

    async def run() -> None:
        registry = Registry()
        registry.add(WorkerRecord("mixed-0", "mixed", 0, 1))
        controller = Controller(config, registry)
        launching = asyncio.Event()

        async def unplaceable(group: GroupConfig, worker_id: str) -> None:
            launching.set()
            await asyncio.Event().wait()

        controller._launch = unplaceable  # type: ignore[method-assign]
        replacement = asyncio.create_task(controller._replace("mixed-0"))
        controller._tasks.add(replacement)
        await launching.wait()
        await controller.shutdown(0.1)
        assert replacement.done()  # cancelled before shutdown returned

    asyncio.run(run())
