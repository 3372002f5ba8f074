"""A request whose worker is lost before its first token goes to another worker.

Real `WorkerServer`s and a real `Router` over gRPC on loopback; the backends are the fakes of
`tests.fakes` (tokens when the test says). Lost means: the worker refused the request as
unavailable (its backend raised the engine's `EngineClosedError`, as a decode worker whose step
loop died or whose KV fabric was abandoned does), its Connect stream broke (the server stopped,
as when its process dies), or the controller took it out of service. A request that already
streamed a token is never sent again: the client saw part of it.
"""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from orchestrator.errors import WorkerFailedError
from orchestrator.router.types import GenerationInput
from tests.fakes import FakeBackend, FakeLateRefusalBackend, FakeRefusingBackend
from tests.orchestrator.harness import (
    BUG_BOUND,
    Servers,
    collect,
    next_event,
    round_robin_router,
)
from tests.waiting import wait_until_async
from workers.metrics import Metrics


def _retries(registry: CollectorRegistry, kind: str) -> float | None:
    labels = {"role": "router", "model": "m", "kind": kind}
    return registry.get_sample_value("pdserve_router_retries_total", labels)


def test_a_request_refused_as_unavailable_is_served_by_another_worker(
    worker_servers: Servers,
) -> None:
    refusing, healthy = FakeRefusingBackend(), FakeBackend()
    addresses = [
        worker_servers.start(refusing, "decode-0"),
        worker_servers.start(healthy, "decode-1"),
    ]
    registry = CollectorRegistry()

    async def run() -> None:
        router = round_robin_router(addresses, metrics=Metrics(registry, role="router", model="m"))
        for n in range(3):
            request_id = f"r{n}"
            task = asyncio.create_task(collect(router, request_id))
            await wait_until_async(lambda r=request_id: r in healthy.sinks, 4.0)  # type: ignore[misc]
            healthy.emit(request_id, ord("k"), "length")
            (event,) = await task
            assert (event.text, event.finish_reason) == ("k", "length")
        # The first request was refused, then served by decode-1; the refusing worker is
        # suspect from then on, so the next ones went to decode-1 directly.
        assert refusing.refused == 1
        assert (_retries(registry, "worker"), _retries(registry, "prefill")) == (1, 0)
        assert router.num_outstanding == 0
        await router.close()

    asyncio.run(run())


def test_without_retries_or_another_worker_the_refusal_fails_the_request(
    worker_servers: Servers,
) -> None:
    refusing = FakeRefusingBackend()
    address = worker_servers.start(refusing, "decode-0")

    async def run() -> None:
        for addresses, retries in (([address], 3), ([address, address], 0)):
            router = round_robin_router(addresses, worker_retries=retries)
            with pytest.raises(WorkerFailedError, match="KV fabric unusable"):
                await anext(router.generate(GenerationInput("doomed", "x")))
            assert router.num_outstanding == 0
            await router.close()
        assert refusing.refused == 2  # one attempt each

    asyncio.run(run())


def test_a_worker_lost_before_the_first_token_is_replaced_after_it_is_not(
    worker_servers: Servers,
) -> None:
    dying, healthy = FakeBackend(), FakeBackend()
    addresses = [worker_servers.start(dying, "decode-0"), worker_servers.start(healthy, "decode-1")]

    async def run() -> None:
        router = round_robin_router(addresses)
        # decode-0 takes "early" (round robin) and dies before its first token.
        early = asyncio.create_task(collect(router, "early"))
        await wait_until_async(lambda: "early" in dying.sinks, 4.0)
        worker_servers.stop(addresses[0])
        await wait_until_async(lambda: "early" in healthy.sinks, 10.0)
        healthy.emit("early", ord("a"), "length")
        assert [event.text for event in await early] == ["a"]

        # A request that already streamed a token when its worker went away fails.
        stream = router.generate(GenerationInput("late", "x"))
        first = asyncio.create_task(anext(stream))
        await wait_until_async(lambda: "late" in healthy.sinks, 4.0)
        healthy.emit("late", ord("b"))
        assert (await first).text == "b"
        router.registry.set_health("decode-1", "unhealthy")
        with pytest.raises(WorkerFailedError, match="health check"):
            await anext(stream)
        assert [i for i in healthy.worker_request_ids if i.startswith("late#")] == ["late#3"]
        await stream.aclose()
        assert router.num_outstanding == 0
        await router.close()

    asyncio.run(run())


def test_a_request_cancelled_while_releasing_its_lost_workers_slot_releases_it_once(
    worker_servers: Servers,
) -> None:
    """decode-0 refuses a request as unavailable; the router releases its slot there to
    reroute it, and waits for its queue's lock (the test holds it, as a queued request taking
    it back after its wait does). The client leaves then: the slot is not released again,
    which would free the slot of another request on decode-0."""
    cue, other = FakeLateRefusalBackend(), FakeBackend()
    addresses = [worker_servers.start(cue, "decode-0"), worker_servers.start(other, "decode-1")]

    async def run() -> None:
        router = round_robin_router(addresses)
        holders = [router.generate(GenerationInput(f"hold{i}", "x")) for i in range(2)]
        firsts = [asyncio.create_task(next_event(h)) for h in holders]  # decode-0, decode-1
        await wait_until_async(lambda: "hold0" in cue.sinks and "hold1" in other.sinks)
        cue.entered.clear()
        refused = router.generate(GenerationInput("refused", "x"))  # decode-0
        task = asyncio.create_task(next_event(refused))
        await wait_until_async(cue.entered.is_set, BUG_BOUND)
        await router._room.acquire()
        try:
            cue.gate.set()
            # Its slot is released; the router waits for the lock to wake the queue.
            await wait_until_async(lambda: router._outstanding["decode-0"] == 1, BUG_BOUND)
            task.cancel()  # lands in that wait
        finally:
            router._room.release()
        await asyncio.gather(task, return_exceptions=True)
        await refused.aclose()
        assert router._outstanding == {"decode-0": 1, "decode-1": 1}  # the holders'
        for task in firsts:
            task.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)
        for holder in holders:
            await holder.aclose()
        await router.close()

    asyncio.run(run())
