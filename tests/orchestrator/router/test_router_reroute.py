"""A request whose worker is lost before its first token goes to another worker.

Real `WorkerServer`s and a real `Router` over gRPC on loopback; the backends are the fakes of
`test_router_units` (tokens when the test says so). Lost means: the worker refused the request
as unavailable (its backend raised the engine's `EngineClosedError`, as a decode worker whose
step loop died or whose KV fabric was abandoned does), its Connect stream broke (the server
stopped, as when its process dies), or the controller took it out of service. A request that
already streamed a token is never sent again: the client saw part of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

import pytest
from prometheus_client import CollectorRegistry

from orchestrator.errors import WorkerFailedError
from orchestrator.registry import Registry, WorkerRecord
from orchestrator.router import GenerationInput, Router, RouterSettings, StreamEvent
from orchestrator.worker_backend import Sink
from orchestrator.worker_service import WorkerServer, WorkerServicer
from tests.orchestrator.cluster_helpers import wait_until_async
from tests.orchestrator.test_router_units import FakeBackend
from workers.engine.errors import EngineClosedError
from workers.engine.sampling_params import SamplingParams
from workers.engine.tokenizer import ByteTokenizer
from workers.metrics import Metrics


class RefusingBackend(FakeBackend):
    """Refuses every request as its worker's engine does once it is closed or unusable."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = 0

    def submit(
        self, request_id: str, prompt: Sequence[int], params: SamplingParams, ep: bytes, sink: Sink
    ) -> None:
        self.refused += 1
        raise EngineClosedError("KV fabric unusable: engine abandoned")


class Servers:
    """Worker servers of one test, stopped at its end unless the test stopped them."""

    def __init__(self) -> None:
        self.running: list[WorkerServer] = []

    def start(self, backend: FakeBackend, worker_id: str) -> str:
        server = WorkerServer(WorkerServicer(worker_id, backend))
        self.running.append(server)
        return server.address

    def stop(self, address: str) -> None:
        """As when the worker's process dies: its streams break."""
        server = next(s for s in self.running if s.address == address)
        self.running.remove(server)
        server.stop(0)


@pytest.fixture
def servers() -> Iterator[Servers]:
    started = Servers()
    yield started
    for server in started.running:
        server.stop(0.1)


async def _collect(router: Router, request_id: str) -> list[StreamEvent]:
    """Every event of a request, until its stream ends (its slot then released)."""
    return [event async for event in router.generate(GenerationInput(request_id, "x"))]


def _router(
    addresses: list[str], worker_retries: int = 1, metrics: Metrics | None = None
) -> Router:
    registry = Registry()
    for i, address in enumerate(addresses):
        registry.add(WorkerRecord(f"decode-{i}", "decode", i, health="healthy", address=address))
    settings = RouterSettings(
        serving_role="decode",
        is_disaggregated=False,
        vocab_size=512,
        max_model_len=64,
        pool_tokens=1024,
        capacity_per_worker=4,
        max_queue=4,
        default_max_tokens=8,
        policy="round_robin",  # decode-0 first
        worker_retries=worker_retries,
    )
    return Router(settings, registry, ByteTokenizer(), metrics)


def _retries(registry: CollectorRegistry, kind: str) -> float | None:
    labels = {"role": "router", "model": "m", "kind": kind}
    return registry.get_sample_value("pdserve_router_retries_total", labels)


def test_a_request_refused_as_unavailable_is_served_by_another_worker(servers: Servers) -> None:
    refusing, healthy = RefusingBackend(), FakeBackend()
    addresses = [servers.start(refusing, "decode-0"), servers.start(healthy, "decode-1")]
    registry = CollectorRegistry()

    async def run() -> None:
        router = _router(addresses, metrics=Metrics(registry, role="router", model="m"))
        for n in range(3):
            request_id = f"r{n}"
            task = asyncio.create_task(_collect(router, request_id))
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
    servers: Servers,
) -> None:
    refusing = RefusingBackend()
    address = servers.start(refusing, "decode-0")

    async def run() -> None:
        for addresses, retries in (([address], 3), ([address, address], 0)):
            router = _router(addresses, worker_retries=retries)
            with pytest.raises(WorkerFailedError, match="KV fabric unusable"):
                await anext(router.generate(GenerationInput("doomed", "x")))
            assert router.num_outstanding == 0
            await router.close()
        assert refusing.refused == 2  # one attempt each

    asyncio.run(run())


def test_a_worker_lost_before_the_first_token_is_replaced_after_it_is_not(
    servers: Servers,
) -> None:
    dying, healthy = FakeBackend(), FakeBackend()
    addresses = [servers.start(dying, "decode-0"), servers.start(healthy, "decode-1")]

    async def run() -> None:
        router = _router(addresses)
        # decode-0 takes "early" (round robin) and dies before its first token.
        early = asyncio.create_task(_collect(router, "early"))
        await wait_until_async(lambda: "early" in dying.sinks, 4.0)
        servers.stop(addresses[0])
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
