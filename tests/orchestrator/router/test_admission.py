"""Admission: which requests the router takes, queues or refuses, with real `WorkerServer`s
on loopback (`tests.fakes.FakeBackend`: tokens when the test says). Bad requests, a full
queue, duplicate ids; a drain that lets accepted requests finish; a queued request whose client
left; the running / waiting gauges."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from orchestrator.control.registry import Registry, WorkerRecord
from orchestrator.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    QueueFullError,
    UnavailableError,
)
from orchestrator.router.core import Router
from orchestrator.router.types import GenerationInput, RouterSettings
from tests.fakes import FakeBackend
from tests.orchestrator.harness import BUG_BOUND, Servers, decode_router, next_event
from tests.waiting import wait_until_async
from workers.engine.tokenizer import ByteTokenizer
from workers.metrics import Metrics


def test_bad_requests_queue_full_and_duplicates(worker: Any) -> None:
    backend, server = worker

    async def run() -> None:
        router = decode_router(server.address, capacity=1, max_queue=1)
        with pytest.raises(InvalidRequestError):  # rejected by the worker
            await anext(router.generate(GenerationInput(prompt_token_ids=[0, 1])))
        with pytest.raises(InvalidRequestError):  # rejected by the router: prompt too long
            await anext(router.generate(GenerationInput(prompt_token_ids=[1] * 64)))
        running = router.generate(GenerationInput(request_id="a", prompt="x"))
        task = asyncio.create_task(next_event(running))
        await wait_until_async(lambda: "a" in backend.sinks, 4.0)
        with pytest.raises(DuplicateRequestError):
            await anext(router.generate(GenerationInput(request_id="a", prompt="x")))
        queued = asyncio.create_task(next_event(router.generate(GenerationInput(prompt="y"))))
        await wait_until_async(lambda: router.num_queued == 1, 4.0)
        with pytest.raises(QueueFullError):
            await anext(router.generate(GenerationInput(prompt="z")))
        task.cancel()
        queued.cancel()
        await asyncio.gather(task, queued, return_exceptions=True)
        await running.aclose()
        await wait_until_async(lambda: "a" in backend.aborted, 4.0)
        await router.close()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("request_id", "message"),
    [
        ("r" * 257, "request_id of 257 bytes exceeds the limit of 256 bytes"),
        ("é" * 129, "request_id of 258 bytes"),
        ("line\nbreak", "request_id must be printable"),
        ("nul\x00", "request_id must be printable"),
    ],
)
def test_a_request_id_is_bounded_printable_text(worker: Any, request_id: str, message: str) -> None:
    backend, server = worker

    async def run() -> None:
        router = decode_router(server.address)
        with pytest.raises(InvalidRequestError, match=message):
            await anext(router.generate(GenerationInput(request_id=request_id, prompt="x")))
        assert not backend.sinks  # refused before any worker saw it
        ok = "r" * 256  # the limit itself is accepted
        stream = router.generate(GenerationInput(request_id=ok, prompt="x"))
        task = asyncio.create_task(next_event(stream))
        await wait_until_async(lambda: ok in backend.sinks, 4.0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await stream.aclose()
        await router.close()

    asyncio.run(run())


def test_a_draining_router_refuses_new_requests_and_lets_running_ones_finish(worker: Any) -> None:
    backend, server = worker

    async def run() -> None:
        router = decode_router(server.address)
        stream = router.generate(GenerationInput(request_id="r", prompt="x"))
        first = asyncio.create_task(next_event(stream))
        await wait_until_async(lambda: "r" in backend.sinks, 4.0)
        drain = asyncio.create_task(router.drain(30))
        await wait_until_async(lambda: router.draining, 4.0)
        with pytest.raises(UnavailableError):
            await anext(router.generate(GenerationInput(prompt="y")))
        backend.emit("r", ord("a"), "stop")
        assert (await first).finish_reason == "stop"
        await stream.aclose()
        await asyncio.wait_for(drain, 10)  # returns once the running request finished
        await router.close()

    asyncio.run(run())


def test_a_draining_router_serves_what_it_queued_before_the_drain(worker: Any) -> None:
    """Accepted means served (or an error): a request queued when the drain began gets the
    room a finishing request frees within the grace period; one still queued when the grace
    period ends gets UNAVAILABLE."""
    backend, server = worker

    async def run() -> None:
        router = decode_router(server.address, capacity=1, max_queue=2)
        running = router.generate(GenerationInput(request_id="running", prompt="x"))
        first = asyncio.create_task(next_event(running))
        await wait_until_async(lambda: "running" in backend.sinks, 4.0)
        queued = router.generate(GenerationInput(request_id="queued", prompt="x"))
        waiting = asyncio.create_task(next_event(queued))
        await wait_until_async(lambda: router.num_queued == 1, 4.0)
        drain = asyncio.create_task(router.drain(30))
        await wait_until_async(lambda: router.draining, 4.0)
        with pytest.raises(UnavailableError):
            await anext(router.generate(GenerationInput(prompt="new")))
        backend.emit("running", ord("a"), "stop")
        assert (await first).finish_reason == "stop"
        await running.aclose()
        await wait_until_async(lambda: "queued" in backend.sinks, 4.0)  # it got the freed room
        backend.emit("queued", ord("b"), "stop")
        assert (await waiting).finish_reason == "stop"
        await queued.aclose()
        await asyncio.wait_for(drain, 10)

        # Grace over with a request still queued: it ends with UNAVAILABLE.
        router = decode_router(server.address, capacity=1, max_queue=2)
        held = router.generate(GenerationInput(request_id="held", prompt="x"))
        holding = asyncio.create_task(next_event(held))
        await wait_until_async(lambda: "held" in backend.sinks, 4.0)
        late = router.generate(GenerationInput(request_id="late", prompt="x"))
        late_task = asyncio.create_task(next_event(late))
        await wait_until_async(lambda: router.num_queued == 1, 4.0)
        await router.drain(0.2)
        with pytest.raises(UnavailableError):
            await late_task
        holding.cancel()
        await asyncio.gather(holding, return_exceptions=True)
        await router.close()

    asyncio.run(run())


def test_a_queued_request_cancelled_as_its_wait_ends_is_not_admitted(
    worker_servers: Servers,
) -> None:
    """One slot: a holder ends and wakes the queued request; its client leaves one more loop
    turn later each round. On Python 3.11 ``wait_for`` dropped a cancel landing as the wait
    completed: the request was admitted and ran for nobody (its task never ended)."""
    backend = FakeBackend()
    address = worker_servers.start(backend, "decode-0")

    async def run() -> None:
        router = decode_router(address, capacity=1, max_queue=1)
        for turns in range(8):
            holder = router.generate(GenerationInput(f"hold{turns}", "hi"))
            first = asyncio.create_task(next_event(holder))
            await wait_until_async(lambda n=f"hold{turns}": n in backend.sinks, BUG_BOUND)  # type: ignore[misc]
            backend.emit(f"hold{turns}", ord("x"), "length")
            await first
            queued = router.generate(GenerationInput(f"queued{turns}", "hi"))
            task = asyncio.create_task(next_event(queued))
            await wait_until_async(lambda: router.num_queued == 1, BUG_BOUND)
            await holder.aclose()  # releases the slot: the queued request is woken
            for _ in range(turns):
                await asyncio.sleep(0)
            task.cancel()
            await wait_until_async(task.done, BUG_BOUND)
            assert task.cancelled(), turns
            await queued.aclose()
            assert router.num_outstanding == 0
        await router.close()

    asyncio.run(run())


def _gauges(registry: CollectorRegistry) -> tuple[float | None, float | None]:
    labels = {"role": "router", "model": "m"}
    return (
        registry.get_sample_value("pdserve_num_requests_running", labels),
        registry.get_sample_value("pdserve_num_requests_waiting", labels),
    )


def test_the_running_gauge_counts_no_request_whose_admission_failed(
    worker_servers: Servers,
) -> None:
    backend = FakeBackend()
    address = worker_servers.start(backend, "decode-0")
    registry = CollectorRegistry()

    async def run() -> None:
        workers = Registry()
        workers.add(WorkerRecord("decode-0", "decode", 0, health="healthy", address=address))
        settings = RouterSettings(
            "decode", False, 512, 64, 1024, capacity_per_worker=1, max_queue=1,
            default_max_tokens=8,
        )  # fmt: skip
        metrics = Metrics(registry, role="router", model="m")
        router = Router(settings, workers, ByteTokenizer(), metrics)
        holder = router.generate(GenerationInput("holder", "hi"))
        first = asyncio.create_task(next_event(holder))
        await wait_until_async(lambda: "holder" in backend.sinks, BUG_BOUND)
        backend.emit("holder", ord("x"))
        await first
        queued = asyncio.create_task(next_event(router.generate(GenerationInput("queued", "hi"))))
        await wait_until_async(lambda: router.num_queued == 1, BUG_BOUND)
        with pytest.raises(QueueFullError):
            await anext(router.generate(GenerationInput("refused", "hi")))
        assert _gauges(registry) == (1, 1)
        queued.cancel()  # its client left the queue
        await asyncio.gather(queued, return_exceptions=True)
        assert _gauges(registry) == (1, 0)
        await holder.aclose()
        workers.set_health("decode-0", "unhealthy")
        with pytest.raises(UnavailableError):
            await anext(router.generate(GenerationInput("nowhere", "hi")))
        assert _gauges(registry) == (0, 0)
        await router.close()

    asyncio.run(run())
