"""The control plane: shutdown ends what it started, replacements in progress included, and a
late health answer from a replaced actor changes nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import ray

from orchestrator.config import ClusterConfig
from orchestrator.config_sections import GroupConfig
from orchestrator.controller import Controller, ControllerOptions, _Placed
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


class _SlowActor:
    """Fake, named: a Ray actor handle whose `state` answers only when the test says, as a
    worker stalled past one health check and answering a later one would. A real actor cannot
    be made to answer at a chosen moment."""

    def __init__(self) -> None:
        self.answer = asyncio.Event()
        self.asked = asyncio.Event()

    @property
    def state(self) -> _SlowActor:
        return self

    def remote(self) -> asyncio.Future[dict[str, object]]:
        async def reply() -> dict[str, object]:
            self.asked.set()
            await self.answer.wait()
            return {"health": "healthy", "num_free_kv_pages": 1, "num_total_kv_pages": 1}

        return asyncio.ensure_future(reply())


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
        old = _SlowActor()
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

    asyncio.run(run())
    assert not ray.is_initialized()  # the cluster tests after this one start their own
