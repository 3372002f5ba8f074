"""A node that cannot open the model, on real Ray (the session's in-process one): the worker's
`ModelNotOnNodeError` fails the controller's start with the worker's own message (not Ray's
remote traceback); a replacement that meets it is tried once, not again and again, and leaves
the worker unhealthy with the error in its record; a scale-up that meets it fails naming it.

"A node without the model" is this host after the model directory moved away (storage
unmounted under a running cluster), or a path that never existed here.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import ray

from orchestrator.control.controller import Controller, ControllerOptions
from orchestrator.control.registry import Registry
from orchestrator.errors import UnavailableError
from tests.system.cluster_helpers import cluster_config, mixed_groups
from workers.service.model_dir import ModelNotOnNodeError

pytestmark = pytest.mark.slow

OPTIONS = ControllerOptions(health_interval_seconds=0.2, worker_metrics_port=None)


async def _until(check: Callable[[], object], what: str, timeout: float = 120) -> None:
    async def poll() -> None:
        while not check():
            await asyncio.sleep(0.1)

    try:
        await asyncio.wait_for(poll(), timeout)
    except TimeoutError:
        pytest.fail(f"timed out waiting for {what}")


def test_a_start_on_a_node_without_the_model_fails_with_the_workers_message(
    ray_local: None, tmp_path: Path
) -> None:
    missing = tmp_path / "models" / "absent"
    controller = Controller(cluster_config(missing, mixed_groups(1)), Registry(), OPTIONS)

    async def run() -> None:
        try:
            with pytest.raises(ModelNotOnNodeError) as raised:
                await controller.start()
        finally:
            await controller.shutdown(0.1)
        error = raised.value
        assert not isinstance(error, ray.exceptions.RayError)  # the cause, not Ray's wrapper
        assert (error.worker_id, error.path) == ("mixed-0", str(missing))
        assert str(error).startswith(f"mixed-0 on node {error.node}: no checkpoint at {missing}")
        assert error.node  # the Ray node's IP

    asyncio.run(run())


def test_a_replacement_on_a_node_without_the_model_is_not_retried(
    ray_local: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    registry = Registry()
    controller = Controller(cluster_config(model, mixed_groups(1)), registry, OPTIONS)

    async def run() -> None:
        try:
            await controller.start()
            record = registry.workers["mixed-0"]
            assert record.is_ready and record.failure == ""
            model.rename(tmp_path / "moved")  # the node loses the model under the cluster
            ray.kill(controller.handle_of("mixed-0"), no_restart=True)
            await _until(lambda: record.failure, "the replacement to give up")
            assert record.health == "unhealthy" and record.generation == 1  # one attempt
            assert f"mixed-0 on node {record.node_ip}: no checkpoint at {model}" in record.failure
            await _until(lambda: not controller._tasks, "the replacement task to end")
            with pytest.raises(UnavailableError) as raised:
                await controller.scale("mixed", 2, grace_seconds=0.1)
            assert "mixed-1 did not start (ModelNotOnNodeError: mixed-1 on node" in str(
                raised.value
            )
            assert sorted(registry.workers) == ["mixed-0"]
        finally:
            await controller.shutdown(0.1)

    asyncio.run(run())
