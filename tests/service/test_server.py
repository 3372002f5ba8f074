"""The worker's gRPC service against a real engine (tiny preset): a client that leaves while
its request is being submitted, a duplicate id on a Connect stream, an engine that cannot take
requests, and `pdserve generate` when its reader leaves."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from orchestrator.worker_backend import MixedBackend
from orchestrator.worker_service import WorkerServer, WorkerServicer
from protos.pdserve.v1 import worker_pb2 as wpb
from protos.pdserve.v1 import worker_pb2_grpc as wpb_grpc
from tests.orchestrator.cluster_helpers import wait_until_async
from workers.engine.config import EngineConfig
from workers.engine.errors import EngineClosedError


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


def test_a_client_leaving_while_its_request_is_submitted_aborts_it(
    mixed: tuple[MixedBackend, WorkerServer],
) -> None:
    """The submit waits for the engine's current step; a client deadline in that window used
    to leave the request running to max_tokens for nobody."""
    backend, server = mixed
    real_step = backend.engine.step

    def slow_step():  # type: ignore[no-untyped-def]
        time.sleep(0.4)  # a long step: a big prefill chunk on a loaded machine
        return real_step()

    async def run() -> None:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = wpb_grpc.WorkerStub(channel)
            busy = stub.Generate(request("busy", 400))
            await anext(busy.__aiter__())
            backend.engine.step = slow_step  # type: ignore[method-assign]
            await asyncio.sleep(0.5)  # a slow step is running
            with pytest.raises(grpc.aio.AioRpcError) as left:
                async for _ in stub.Generate(request("victim", 400), timeout=0.15):
                    pass
            assert left.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            busy.cancel()
            await wait_until_async(lambda: in_engine(backend) == [])

    try:
        asyncio.run(run())
    finally:
        backend.engine.step = real_step  # type: ignore[method-assign]


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


# --- `pdserve generate` ------------------------------------------------------------------------


class _Streams:
    """Fake, named: a Generation server whose stream ends as the test needs. pdserve's router
    always ends a stream with a finish reason; a proxy or a dying router may not."""

    @staticmethod
    def serve() -> tuple[str, Callable[[], None]]:
        import threading

        from orchestrator.client import pb, pb_grpc

        class Servicer(pb_grpc.GenerationServicer):  # type: ignore[misc]
            async def Generate(self, request, context):  # type: ignore[no-untyped-def]
                if request.prompt == "long":
                    for _ in range(2000):
                        yield pb.GenerateResponse(text="token " * 50)
                    yield pb.GenerateResponse(finish_reason="length")
                else:  # "no finish"
                    yield pb.GenerateResponse(text="partial")

        loop = asyncio.new_event_loop()
        ready: list[str] = []

        async def start() -> grpc.aio.Server:
            server = grpc.aio.server()
            pb_grpc.add_GenerationServicer_to_server(Servicer(), server)
            ready.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
            await server.start()
            return server

        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        server = asyncio.run_coroutine_threadsafe(start(), loop).result(30)

        def stop() -> None:
            asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)

        return ready[0], stop


def test_generate_reports_a_stream_without_a_finish_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from orchestrator.cli import main

    address, stop = _Streams.serve()
    try:
        assert main(["generate", "--address", address, "no finish"]) == 1
    finally:
        stop()
    assert "the stream ended without a finish reason" in capsys.readouterr().err


def test_generate_into_a_closed_pipe_ends_quietly() -> None:
    import subprocess
    import sys

    address, stop = _Streams.serve()
    try:
        pipeline = subprocess.run(
            f"{sys.executable} -m orchestrator.cli generate --address {address} long | head -c 100",
            shell=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        stop()
    assert len(pipeline.stdout) == 100
    assert "Traceback" not in pipeline.stderr, pipeline.stderr
