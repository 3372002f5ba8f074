"""Suspect workers (`Suspects`): a worker whose Connect stream broke is not chosen until the
controller replaced it or its hold time passed, although the registry still says healthy."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.errors import UnavailableError, WorkerFailedError
from orchestrator.router.suspicion import Suspects
from orchestrator.router.types import GenerationInput
from tests.fakes import FakeBackend
from tests.orchestrator.harness import decode_router, next_event, record
from tests.waiting import wait_until_async
from workers.service.server import WorkerServer, WorkerServicer


def test_a_mark_holds_until_its_time_passed_or_the_worker_was_replaced() -> None:
    now = [100.0]
    suspects = Suspects(clock=lambda: now[0])
    worker = record("decode-0", "127.0.0.1:1")
    assert not suspects.is_suspect(worker)
    suspects.mark(worker, hold_seconds=10.0, why="link broke")
    assert suspects.is_suspect(worker)
    now[0] = 109.9
    assert suspects.is_suspect(worker)  # the hold has not passed
    now[0] = 110.0
    assert not suspects.is_suspect(worker)  # it has: chosen again
    assert not suspects.is_suspect(worker)  # and the mark is gone
    suspects.mark(worker, hold_seconds=10.0, why="link broke")
    worker.generation += 1  # replaced by the controller, at a new address
    worker.address = "127.0.0.1:2"
    assert not suspects.is_suspect(worker)
    # A mark names the worker as it was: the same generation at the same address.
    suspects.mark(worker, hold_seconds=10.0, why="refused a request as unavailable")
    assert suspects.is_suspect(worker)
    worker.address = "127.0.0.1:3"
    assert not suspects.is_suspect(worker)


def test_a_broken_link_makes_its_worker_suspect_until_replaced() -> None:
    """The router side alone (real gRPC, a fake backend): a worker whose stream broke is not
    chosen although the registry still says healthy; its replacement (new generation and
    address) is."""
    backend, replacement = FakeBackend(), FakeBackend()
    server = WorkerServer(WorkerServicer("decode-0", backend))
    new_server = WorkerServer(WorkerServicer("decode-0", replacement))

    async def run() -> None:
        router = decode_router(server.address)
        worker = router.registry.workers["decode-0"]
        task = asyncio.create_task(next_event(router.generate(GenerationInput("doomed", "x"))))
        await wait_until_async(lambda: "doomed" in backend.sinks, 4.0)
        server.stop(0)  # the worker dies; the controller has not noticed (still healthy)
        with pytest.raises(WorkerFailedError):
            await task
        assert worker.is_ready
        with pytest.raises(UnavailableError, match="no ready decode worker"):
            await anext(router.generate(GenerationInput("next", "x")))
        # Replaced: new generation at a new address, routable at once.
        worker.generation += 1
        worker.address = new_server.address
        task = asyncio.create_task(next_event(router.generate(GenerationInput("served", "x"))))
        await wait_until_async(lambda: "served" in replacement.sinks, 4.0)
        replacement.emit("served", ord("k"), "length")
        assert (await task).finish_reason == "length"
        await router.close()

    try:
        asyncio.run(run())
    finally:
        new_server.stop(0.1)
