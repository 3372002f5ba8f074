"""Worker servers on loopback for the router and API tests (see `tests.orchestrator.harness`;
the ``worker_servers`` fixture, which the worker service's tests use too, is in ``tests/conftest.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes import FakeBackend
from tests.orchestrator.harness import MAX_MODEL_LEN, NUM_PAGES
from workers.engine.config import EngineConfig
from workers.service.backend import MixedBackend
from workers.service.server import WorkerServer, WorkerServicer


@pytest.fixture
def worker() -> Iterator[tuple[FakeBackend, WorkerServer]]:
    """Worker ``decode-0`` on a `FakeBackend`."""
    backend = FakeBackend()
    server = WorkerServer(WorkerServicer("decode-0", backend))
    try:
        yield backend, server
    finally:
        server.stop(0.1)


@pytest.fixture(scope="module")
def mixed_worker(tiny_model_dir: Path) -> Iterator[tuple[MixedBackend, WorkerServer]]:
    """Worker ``mixed-0`` running the tiny preset (`tests.orchestrator.harness.mixed_router`)."""
    backend = MixedBackend(
        tiny_model_dir, EngineConfig(num_pages=NUM_PAGES, max_model_len=MAX_MODEL_LEN)
    )
    server = WorkerServer(WorkerServicer("mixed-0", backend))
    try:
        yield backend, server
    finally:
        server.stop(0.1)
        backend.close()
