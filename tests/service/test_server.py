"""The worker's gRPC service against a real engine (tiny preset): a client that leaves while
its request is being submitted, a burst of requests during one step, a duplicate id on a Connect
stream, an engine that cannot take requests."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from protos.pdserve.v1 import worker_pb2 as wpb
from protos.pdserve.v1 import worker_pb2_grpc as wpb_grpc
from tests.waiting import wait_until_async
from workers.engine.config import EngineConfig
from workers.engine.errors import EngineClosedError
from workers.service.backend import MixedBackend
from workers.service.server import WorkerServer, WorkerServicer

# Bounds the waits for what a bug prevents; the client's deadline is well within it.
BOUND = 30.0
DEADLINE_S = 1.0


@pytest.fixture
def mixed(tiny_model_dir: Path) -> Iterator[tuple[MixedBackend, WorkerServer]]:
    backend = MixedBackend(tiny_model_dir, EngineConfig(num_pages=128, max_model_len=512))
    server = WorkerServer(WorkerServicer("mixed-0", backend))
    try:
        yield backend, server
    finally:
        server.stop(0.1)
        backend.close()


def request(request_id: str, max_tokens: int) -> wpb.WorkerGenerateRequest:
    return wpb.WorkerGenerateRequest(
        request_id=request_id,
        prompt_token_ids=[1, 2, 3, 4, 5],
        sampling=wpb.WorkerSamplingParams(
            temperature=0.0, top_p=1.0, repetition_penalty=1.0, max_tokens=max_tokens,
            ignore_eos=True,
        ),
    )  # fmt: skip


def in_engine(backend: MixedBackend) -> list[str]:
    return backend._loop.call(lambda: list(backend.engine._requests))


class HeldSteps:
    """Swaps the engine's step: after `hold`, a step waits for ``release`` before it runs (as a
    big prefill chunk on a loaded machine runs long), with ``stepping`` set while it waits."""

    def __init__(self, backend: MixedBackend) -> None:
        self.engine = backend.engine
        self.real_step = backend.engine.step
        self.stepping, self.release = threading.Event(), threading.Event()

    def hold(self) -> None:
        self.engine.step = self._held  # type: ignore[method-assign]

    def _held(self):  # type: ignore[no-untyped-def]
        self.stepping.set()
        self.release.wait(BOUND)
        return self.real_step()


@contextmanager
def held_steps(backend: MixedBackend) -> Iterator[HeldSteps]:
    """`HeldSteps` for the block; on leaving, any held step is released and the engine's own
    step is back."""
    held = HeldSteps(backend)
    try:
        yield held
    finally:
        held.release.set()
        backend.engine.step = held.real_step  # type: ignore[method-assign]


def test_a_client_leaving_while_its_request_is_submitted_aborts_it(
    mixed: tuple[MixedBackend, WorkerServer],
) -> None:
    """The submit waits for the engine's current step; a client deadline in that window used
    to leave the request running to max_tokens for nobody. The step is held (as a big prefill
    chunk on a loaded machine runs long) until the deadline has passed."""
    backend, server = mixed

    async def run(held: HeldSteps) -> None:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = wpb_grpc.WorkerStub(channel)
            busy = stub.Generate(request("busy", 400))
            await anext(busy.__aiter__())
            held.hold()
            await wait_until_async(held.stepping.is_set, BOUND)  # a long step is running

            async def victim() -> None:
                async for _ in stub.Generate(request("victim", 400), timeout=DEADLINE_S):
                    pass

            leaving = asyncio.create_task(victim())
            # The victim's submit waits for the step (a call queued on the step loop) ...
            await wait_until_async(
                lambda: backend._loop._calls.qsize() > 0, DEADLINE_S, "the submit waiting"
            )
            # ... when its client's deadline passes.
            with pytest.raises(grpc.aio.AioRpcError) as left:
                await leaving
            assert left.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            held.release.set()
            busy.cancel()
            await wait_until_async(lambda: in_engine(backend) == [])

    with held_steps(backend) as held:
        asyncio.run(run(held))


def test_every_request_that_arrives_during_a_step_joins_the_next_one(
    mixed: tuple[MixedBackend, WorkerServer],
) -> None:
    """A submit holds a thread until the step thread takes it, between two steps. With a
    fixed pool of 4 threads, a worker took at most 4 new requests per step, the rest one or
    more steps later (under load on a CPU, seconds of TTFT each). While a step is held, more
    requests than that arrive: all of them wait on the step thread when it ends, and the next
    step admits them all."""
    backend, server = mixed
    arrivals = 12
    admitted: list[int] = []

    async def run(held: HeldSteps) -> None:
        def counting_step():  # type: ignore[no-untyped-def]
            admitted.append(len(backend.engine._requests))
            return held.real_step()

        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = wpb_grpc.WorkerStub(channel)
            busy = stub.Generate(request("busy", 400))
            await anext(busy.__aiter__())
            held.hold()
            await wait_until_async(held.stepping.is_set, BOUND)

            async def client(n: int) -> int:
                return len([r async for r in stub.Generate(request(f"r{n}", 2))])

            clients = [asyncio.create_task(client(n)) for n in range(arrivals)]
            await wait_until_async(
                lambda: backend._loop._calls.qsize() == arrivals,
                BOUND,
                f"all {arrivals} submits waiting on the step thread",
            )
            backend.engine.step = counting_step  # type: ignore[method-assign]
            held.release.set()
            assert all(replies > 0 for replies in await asyncio.gather(*clients))
            # The step after the held one ran the busy request and every arrival.
            assert admitted[0] == 1 + arrivals
            busy.cancel()
            await wait_until_async(lambda: in_engine(backend) == [])

    with held_steps(backend) as held:
        asyncio.run(run(held))


def test_a_duplicate_id_on_connect_leaves_the_live_request_tracked(
    mixed: tuple[MixedBackend, WorkerServer],
) -> None:
    backend, server = mixed

    async def run() -> None:
        async with grpc.aio.insecure_channel(server.address) as channel:
            call = wpb_grpc.WorkerStub(channel).Connect()
            await call.write(wpb.ConnectRequest(generate=request("dup", 480)))
            await call.read()
            await call.write(wpb.ConnectRequest(generate=request("dup", 4)))
            refused = None
            while refused is None:
                reply = await call.read()
                refused = next((d for d in reply.deltas if d.finish_reason), None)
            assert refused.error_code == grpc.StatusCode.ALREADY_EXISTS.value[0]
            assert server.servicer.num_requests == 1  # the live one: a drain waits for it
            call.cancel()  # the router left: the live request is aborted
            await wait_until_async(lambda: in_engine(backend) == [])

    asyncio.run(run())


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (RuntimeError("unexpected"), grpc.StatusCode.INTERNAL),
        (EngineClosedError("the engine's step loop died"), grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_start_failures_have_their_status(
    mixed: tuple[MixedBackend, WorkerServer],
    monkeypatch: pytest.MonkeyPatch,
    error: Exception,
    code: grpc.StatusCode,
) -> None:
    """Fake, named: the backend's submit raises. Unexpected: INTERNAL, as on Connect (not
    gRPC's UNKNOWN); a closed engine: UNAVAILABLE, the router's cue to go elsewhere."""
    backend, server = mixed

    def broken(*args: object) -> None:
        raise error

    monkeypatch.setattr(backend, "submit", broken)

    async def run() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(server.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                async for _ in wpb_grpc.WorkerStub(channel).Generate(request("z", 4)):
                    pass
            return failed.value.code()

    assert asyncio.run(run()) == code


def test_a_worker_with_a_cluster_secret_serves_only_who_presents_it(tiny_model_dir: Path) -> None:
    """Every call but health checks needs the cluster's secret as a bearer token: without it,
    or with another, UNAUTHENTICATED and nothing reaches the engine; the router's link (which
    presents it) is served."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from orchestrator.api.security import token_metadata
    from orchestrator.router.worker_link import WorkerLink

    backend = MixedBackend(tiny_model_dir, EngineConfig(num_pages=64, max_model_len=256))
    server = WorkerServer(WorkerServicer("mixed-0", backend), token="s3cret")

    async def run() -> None:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = wpb_grpc.WorkerStub(channel)
            for metadata in ((), token_metadata("other")):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    async for _ in stub.Generate(request("x", 2), metadata=metadata):
                        pass
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            assert backend.engine.stats.num_sampled_tokens == 0
        link = WorkerLink(server.address, "s3cret")
        try:
            queue = await link.start(request("ok", 2))
            deltas = [await asyncio.wait_for(queue.get(), BOUND)]
            while not getattr(deltas[-1], "finish_reason", "error"):
                deltas.append(await asyncio.wait_for(queue.get(), BOUND))
        finally:
            await link.close()
        assert isinstance(deltas[-1], wpb.RequestDelta), deltas[-1]
        assert deltas[-1].finish_reason == "length"
        assert sum(len(d.token_ids) for d in deltas if isinstance(d, wpb.RequestDelta)) == 2

    try:
        asyncio.run(run())
    finally:
        server.stop(0.1)
        backend.close()
