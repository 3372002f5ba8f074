"""The control plane: shutdown ends what it started, replacements in progress included, and a
late health answer from a replaced actor changes nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import ray

from orchestrator.config.cluster import ClusterConfig
from orchestrator.config.sections import GroupConfig
from orchestrator.control.controller import Controller, ControllerOptions, _Placed
from orchestrator.control.registry import Registry, WorkerRecord
from tests.fakes import FakeSlowActor


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


def test_a_late_answer_from_a_replaced_actor_does_not_mark_its_worker_healthy(
    tmp_path: Path,
) -> None:
    """One health check times out and the worker is being replaced; a second check against
    the old actor, started earlier (a GetClusterState refresh), then gets its answer. The
    worker must stay `starting`: the router would otherwise send requests to the old address
    for the whole relaunch."""
    config = ClusterConfig.from_dict(
        {"model": str(tmp_path / "absent"), "groups": {"mixed": {"replicas": 1}}}
    )

    async def run() -> None:
        registry = Registry()
        registry.add(WorkerRecord("mixed-0", "mixed", 0, 1))
        registry.set_health("mixed-0", "healthy")
        controller = Controller(config, registry, ControllerOptions(health_timeout_seconds=60))
        relaunching = asyncio.Event()

        async def relaunch(group: GroupConfig, worker_id: str) -> None:
            relaunching.set()
            await asyncio.Event().wait()  # the new actor is still loading its model

        controller._launch = relaunch  # type: ignore[method-assign]
        # No Ray actor to kill (`ray.kill` would start a Ray instance in this process, which
        # the cluster tests' own `ray.init` then refuses): the fake is only forgotten.
        controller._discard = lambda worker_id: controller._placed.pop(worker_id, None)  # type: ignore[method-assign,assignment]
        old = FakeSlowActor()
        controller._placed["mixed-0"] = _Placed(old, None)
        late = asyncio.create_task(controller._check("mixed-0"))  # waits for `old.answer`
        await old.asked.wait()
        # The next check gives up sooner (the timeout is read when a check starts).
        controller.options = ControllerOptions(health_timeout_seconds=0.05)
        await controller._check("mixed-0")  # times out: unhealthy, replacement starts
        await relaunching.wait()
        assert "mixed-0" not in controller._placed and not late.done()
        assert registry.workers["mixed-0"].health == "starting"
        old.answer.set()
        await late
        assert registry.workers["mixed-0"].health == "starting"
        await controller.shutdown(0.1)

    ray_before = ray.is_initialized()  # the session's in-process Ray, if a test started it
    asyncio.run(run())
    # This test started no Ray: the cluster tests after it start their own.
    assert ray.is_initialized() == ray_before
