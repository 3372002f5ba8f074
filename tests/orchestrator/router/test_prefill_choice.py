"""Disaggregated serving, the router's side (`PrefillChoice`): the prefill source with the
fewest prompt tokens in flight, another one when a request's KV transfer failed before its
first token, and the decoder's own prefill when none is left. A real `WorkerServer` on loopback
with `tests.fakes.FakePrefillFailingBackend` (a transfer from endpoint b"dead" fails)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest
from prometheus_client import CollectorRegistry

from orchestrator.errors import UnavailableError, WorkerFailedError
from orchestrator.router.core import Router
from orchestrator.router.types import GenerationInput, StreamEvent
from tests.fakes import FakePrefillFailingBackend
from tests.orchestrator.harness import disaggregated_router, next_event
from tests.waiting import wait_until_async
from workers.metrics import Metrics
from workers.service.server import WorkerServer, WorkerServicer


@pytest.mark.parametrize("order", [("dead", "live"), ("live", "dead")])
def test_a_failed_prefill_is_retried_on_another_before_any_token(order: tuple[str, str]) -> None:
    backend = FakePrefillFailingBackend()
    server = WorkerServer(WorkerServicer("decode-0", backend))
    endpoints = {f"prefill-{i}": name.encode() for i, name in enumerate(order)}
    registry = CollectorRegistry()

    async def run() -> None:
        metrics = Metrics(registry, role="router", model="m")
        router = disaggregated_router(server.address, endpoints, retries=1, metrics=metrics)
        served = 0
        for n in range(6):  # the random source is the dead one in some of these
            request_id = f"r{n}"
            task = asyncio.create_task(
                next_event(router.generate(GenerationInput(request_id, "x")))
            )
            await wait_until_async(lambda rid=request_id: rid in backend.sinks, 4.0)  # type: ignore[misc]
            backend.emit(request_id, ord("k"), "length")
            assert (await task).finish_reason == "length"
            served += 1
        assert served == 6
        assert b"dead" in backend.endpoints  # the retry path ran
        # Every request ended on the live source; each dead attempt was followed by a live one.
        assert backend.endpoints.count(b"live") == 6
        labels = {"role": "router", "model": "m"}
        retries = "pdserve_router_retries_total"
        prefill = registry.get_sample_value(retries, {**labels, "kind": "prefill"})
        assert prefill == backend.endpoints.count(b"dead")
        assert registry.get_sample_value(retries, {**labels, "kind": "worker"}) == 0
        await router.close()

    try:
        asyncio.run(run())
    finally:
        server.stop(0.1)


def test_the_router_sends_prefill_to_the_source_with_the_fewest_prompt_tokens_in_flight() -> None:
    backend = FakePrefillFailingBackend()
    server = WorkerServer(WorkerServicer("decode-0", backend))

    registry = CollectorRegistry()

    def gauge(worker_id: str) -> float | None:  # what Prometheus scrapes for the worker
        labels = {"role": "router", "model": "m", "worker": worker_id}
        return registry.get_sample_value("pdserve_router_prefill_tokens_in_flight", labels)

    async def run() -> None:
        metrics = Metrics(registry, role="router", model="m")
        endpoints = {"prefill-0": b"p0", "prefill-1": b"p1"}
        router = disaggregated_router(server.address, endpoints, 0, metrics)
        endpoint_of = {b"p0": "prefill-0", b"p1": "prefill-1"}
        started: list[asyncio.Task[StreamEvent]] = []
        streams: list[AsyncGenerator[StreamEvent, None]] = []

        async def start(request_id: str, prompt: str) -> str:
            stream = router.generate(GenerationInput(request_id, prompt))
            streams.append(stream)
            started.append(asyncio.create_task(next_event(stream)))
            await wait_until_async(lambda: request_id in backend.sinks, 4.0)
            return endpoint_of[backend.endpoints[-1]]

        long_source = await start("long", "x" * 40)
        other = "prefill-1" if long_source == "prefill-0" else "prefill-0"
        assert [await start(f"short{i}", "yy") for i in range(3)] == [other] * 3
        assert router.prefill.load.tokens(long_source) > router.prefill.load.tokens(other) > 0
        assert gauge(long_source) == router.prefill.load.tokens(long_source)
        assert gauge(other) == router.prefill.load.tokens(other)
        # The long prompt's first token: its prefill is over, its source is free again.
        backend.emit("long", ord("a"))
        await asyncio.wait_for(started[0], 10)
        assert router.prefill.load.tokens(long_source) == gauge(long_source) == 0
        backend.emit("short0", ord("b"), "length")  # a slot for one more (capacity 4)
        assert (await started[1]).finish_reason == "length"
        await streams[1].aclose()  # the stream ends: its worker slot is released
        assert await start("next", "zz") == long_source
        for request_id in ("short1", "short2", "next"):
            backend.emit(request_id, ord("b"), "length")
        for task, stream in zip(started[2:], streams[2:], strict=True):
            assert (await task).finish_reason == "length"
            await stream.aclose()
        assert router.prefill.load.tokens("prefill-0") == router.prefill.load.tokens("prefill-1")
        assert router.prefill.load.tokens("prefill-0") == 0
        # A request that ends before its first token (the client went away) releases too.
        gone = await start("gone", "x" * 30)
        assert router.prefill.load.tokens(gone) > 0
        started[-1].cancel()
        with pytest.raises(asyncio.CancelledError):
            await started[-1]
        assert router.prefill.load.tokens(gone) == gauge(gone) == 0
        assert gauge("prefill-0") == gauge("prefill-1") == 0
        await streams[0].aclose()
        await router.close()

    try:
        asyncio.run(run())
    finally:
        server.stop(0.1)


def test_without_retries_or_another_prefill_the_request_fails() -> None:
    backend = FakePrefillFailingBackend()
    server = WorkerServer(WorkerServicer("decode-0", backend))

    async def run() -> None:
        for endpoints, retries in (
            ({"prefill-0": b"dead", "prefill-1": b"dead"}, 0),
            ({"prefill-0": b"dead"}, 3),
        ):
            router = disaggregated_router(server.address, endpoints, retries)
            before = len(backend.endpoints)
            with pytest.raises(WorkerFailedError, match="deadline"):
                await anext(router.generate(GenerationInput("doomed", "x")))
            assert len(backend.endpoints) - before == 1  # no second attempt
            assert router.num_outstanding == 0
            await router.close()

    try:
        asyncio.run(run())
    finally:
        server.stop(0.1)


def test_with_no_other_prefill_source_the_decoder_prefills_the_request_itself() -> None:
    """``local_prefill_fallback``: a request whose only prefill worker failed it, and one sent
    while no prefill worker is ready, go to the decoder with an empty prefill endpoint (it
    prefills them in its own steps); without the fallback both fail."""
    backend = FakePrefillFailingBackend()
    server = WorkerServer(WorkerServicer("decode-0", backend))
    registry = CollectorRegistry()

    async def serve(router: Router, request_id: str) -> None:
        async def events() -> list[StreamEvent]:
            return [e async for e in router.generate(GenerationInput(request_id, "x"))]

        task = asyncio.create_task(events())
        await wait_until_async(lambda: request_id in backend.sinks, 4.0)
        backend.emit(request_id, ord("k"), "length")
        assert [e.finish_reason for e in await task] == ["length"]

    async def run() -> None:
        metrics = Metrics(registry, role="router", model="m")
        router = disaggregated_router(
            server.address, {"prefill-0": b"dead"}, 1, metrics, local_fallback=True
        )
        await serve(router, "failed-over")
        assert backend.endpoints == [b"dead", b""]
        labels = {"role": "router", "model": "m", "kind": "prefill"}
        assert registry.get_sample_value("pdserve_router_retries_total", labels) == 1
        router.registry.set_health("prefill-0", "unhealthy")
        await serve(router, "no-prefill")
        assert backend.endpoints[2:] == [b""]
        assert router.num_outstanding == 0
        await router.close()

        router = disaggregated_router(server.address, {"prefill-0": b"dead"}, 1)
        router.registry.set_health("prefill-0", "unhealthy")
        with pytest.raises(UnavailableError, match="no ready prefill worker"):
            await anext(router.generate(GenerationInput("refused", "x")))
        assert backend.endpoints[3:] == []
        await router.close()

    try:
        asyncio.run(run())
    finally:
        server.stop(0.1)
