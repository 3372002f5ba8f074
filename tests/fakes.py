"""The suite's fakes: stand-ins for a worker's engine backend, a Ray actor handle and a router,
for faults and moments that real ones cannot be made to produce on demand (a token exactly when
a test says, a refusal, an answer that comes late, a stream that ends without a finish reason).

Each says which fault or situation it stands for. Everything around them is real: the worker's
gRPC service, the router, the Connect stream on loopback.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import grpc

from workers.engine.errors import EngineClosedError, InvalidRequestError
from workers.engine.sampling_params import SamplingParams
from workers.service.backend import Sink
from workers.wire import TokenDelta, WorkerLoad, client_request_id

# Bounds the waits of a fake for what a test will do (a test fails then, rather than hangs).
FAKE_WAIT_BOUND = 10.0


class FakeBackend:
    """A decode worker's backend whose tokens come only when the test says so (`emit`): the
    moment of each token, and of the end of a request, is the test's. Records aborts; refuses a
    prompt starting with token 0 as invalid; ``hold_submit`` (cleared) keeps a submit from
    returning, as an engine busy with a long step does; ``entered`` is set as a submit begins.

    Keyed by the client's request id (the router sends per-attempt worker request ids,
    ``"<client id>#<n>"``), so tests name requests as their client did; ``worker_request_ids``
    lists what the worker was really sent.
    """

    role = "decode"

    def __init__(self) -> None:
        self.sinks: dict[str, Sink] = {}
        self.aborted: list[str] = []
        self.worker_request_ids: list[str] = []
        self.hold_submit = threading.Event()
        self.hold_submit.set()
        self.entered = threading.Event()
        self.lock = threading.Lock()

    def submit(
        self, request_id: str, prompt: Sequence[int], params: SamplingParams, _: bytes, sink: Sink
    ) -> None:
        self.entered.set()
        if prompt[0] == 0:
            raise InvalidRequestError("token 0 is refused by this fake")
        self.hold_submit.wait(FAKE_WAIT_BOUND)
        with self.lock:
            self.worker_request_ids.append(request_id)
            self.sinks[client_request_id(request_id)] = sink

    def emit(self, request_id: str, token_id: int, reason: str | None = None) -> None:
        with self.lock:
            sink = self.sinks[request_id]
        sink(TokenDelta([token_id], None, reason is not None, reason))

    def abort(self, request_id: str) -> None:
        with self.lock:
            self.aborted.append(client_request_id(request_id))
            self.sinks.pop(client_request_id(request_id), None)

    def load(self) -> WorkerLoad:
        return WorkerLoad(len(self.sinks), 0, 0, 0)

    def transfer_stats(self, request_id: str) -> dict[str, Any] | None:
        return None

    def step_trace(self) -> dict[str, Any]:
        return {}

    def prefill_endpoint(self) -> bytes:
        return b""

    def cache_naming(self) -> None:
        return None

    def cache_events(self, full: bool = False) -> None:
        return None

    def close(self) -> None:
        pass


class FakePrefillFailingBackend(FakeBackend):
    """A decoder whose KV transfer from prefill endpoint b"dead" fails before any token, as the
    decode messenger reports a prefill worker killed or stalled past the transfer deadline.
    ``endpoints``: the prefill endpoint of every submit, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.endpoints: list[bytes] = []

    def submit(
        self, request_id: str, prompt: Sequence[int], params: SamplingParams, ep: bytes, sink: Sink
    ) -> None:
        self.endpoints.append(ep)
        if ep == b"dead":
            sink(TokenDelta([], None, True, "error", "KV transfer deadline passed"))
            return
        super().submit(request_id, prompt, params, ep, sink)


class FakeRefusingBackend(FakeBackend):
    """Refuses every request as a worker's engine does once it is closed or unusable (its step
    loop died, its KV fabric was abandoned): the router's cue to go elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = 0

    def submit(
        self, request_id: str, prompt: Sequence[int], params: SamplingParams, ep: bytes, sink: Sink
    ) -> None:
        self.refused += 1
        raise EngineClosedError("KV fabric unusable: engine abandoned")


class FakeFinishingBackend(FakeBackend):
    """Ends each request within its submit, as a decode worker may (the request finishing in
    the step that took it in); ``release`` (cleared) holds the submit's return after that."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.release.set()

    def submit(
        self, request_id: str, prompt: Sequence[int], params: SamplingParams, ep: bytes, sink: Sink
    ) -> None:
        super().submit(request_id, prompt, params, ep, sink)
        self.emit(client_request_id(request_id), ord("a"), "length")
        self.release.wait(FAKE_WAIT_BOUND)


class FakeLateRefusalBackend(FakeBackend):
    """Refuses the requests named ``refused*`` as unavailable, as an engine whose step loop
    died while the submit waited for it; the refusal comes only once ``gate`` is set, so the
    test chooses what happens meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def submit(
        self, request_id: str, prompt: Sequence[int], params: SamplingParams, ep: bytes, sink: Sink
    ) -> None:
        if client_request_id(request_id).startswith("refused"):
            self.entered.set()
            self.gate.wait(FAKE_WAIT_BOUND)
            raise EngineClosedError("the engine's step loop died")
        super().submit(request_id, prompt, params, ep, sink)


class FakeFailingAbortBackend(FakeBackend):
    """Fails its next ``num_aborts_to_fail`` aborts as a closed engine does."""

    def __init__(self, num_aborts_to_fail: int) -> None:
        super().__init__()
        self.num_aborts_to_fail = num_aborts_to_fail
        self.num_failed_aborts = 0

    def abort(self, request_id: str) -> None:
        with self.lock:
            fail = self.num_failed_aborts < self.num_aborts_to_fail
            self.num_failed_aborts += fail
        if fail:
            raise EngineClosedError("the engine is closed")
        super().abort(request_id)


class FakeIdleBackend:
    """A mixed worker's backend with nothing running and 7 of 8 KV pages free: only `load` is
    meant to be called (a worker whose state is read, never one given a request)."""

    role = "mixed"

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        prefill_endpoint: bytes,
        sink: Sink,
    ) -> None:
        raise AssertionError("not called")

    def abort(self, request_id: str) -> None:
        pass

    def load(self) -> WorkerLoad:
        return WorkerLoad(0, 0, 7, 8)

    def transfer_stats(self, request_id: str) -> dict[str, Any] | None:
        return None

    def step_trace(self) -> dict[str, Any]:
        return {}

    def prefill_endpoint(self) -> bytes:
        return b""

    def cache_naming(self) -> None:
        return None

    def cache_events(self, full: bool = False) -> None:
        return None

    def close(self) -> None:
        pass


class FakeSlowActor:
    """A Ray actor handle whose `state` answers only when the test says (``answer``), as a
    worker stalled past one health check and answering a later one would; ``asked`` is set
    when the question came. A real actor cannot be made to answer at a chosen moment."""

    def __init__(self) -> None:
        self.answer = asyncio.Event()
        self.asked = asyncio.Event()

    @property
    def state(self) -> FakeSlowActor:
        return self

    def remote(self) -> asyncio.Future[dict[str, object]]:
        async def reply() -> dict[str, object]:
            self.asked.set()
            await self.answer.wait()
            return {"health": "healthy", "num_free_kv_pages": 1, "num_total_kv_pages": 1}

        return asyncio.ensure_future(reply())


class FakeGenerationServer:
    """A ``pdserve.v1.Generation`` server whose streams end as the test needs: prompt "long"
    streams 2000 big text chunks then "length"; any other prompt one chunk and no finish
    reason. pdserve's router always ends a stream with a finish reason; a proxy or a dying
    router may not. Runs on an event loop of its own thread; `stop` ends both."""

    def __init__(self) -> None:
        from orchestrator.api.client import pb, pb_grpc

        class Servicer(pb_grpc.GenerationServicer):  # type: ignore[misc]
            async def Generate(self, request, context):  # type: ignore[no-untyped-def]
                if request.prompt == "long":
                    for _ in range(2000):
                        yield pb.GenerateResponse(text="token " * 50)
                    yield pb.GenerateResponse(finish_reason="length")
                else:  # "no finish"
                    yield pb.GenerateResponse(text="partial")

        self._loop = asyncio.new_event_loop()
        addresses: list[str] = []

        async def start() -> grpc.aio.Server:
            server = grpc.aio.server()
            pb_grpc.add_GenerationServicer_to_server(Servicer(), server)
            addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
            await server.start()
            return server

        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(start(), self._loop).result(30)
        self.address = addresses[0]

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._server.stop(None), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
