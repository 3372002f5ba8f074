"""In-process Ray for the served-system tests: started once per session, on first use (each
module places and removes its own workers on it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.orchestrator import cluster_helpers  # noqa: F401  (sets the Ray environment first)


@pytest.fixture(scope="session")
def ray_local() -> Iterator[None]:
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
