"""The router's token path to a worker: ``pdserve.v1.Worker`` over grpc.aio, one stream per request.

Why gRPC streams (measured in ``bench/router.py``): protobuf deltas on an HTTP/2 stream cost tens
of microseconds per token and carry no pickle; a Ray actor call (or object ref) per token costs
about a millisecond and would serialize through Ray's pickler. The control plane still uses Ray
for placement, health and state; only tokens take this path.

The servicer runs on an event loop of its own thread (`WorkerServer`), next to the backend's
step thread. A backend sink is called on the step thread and only hands each delta to the loop
(``call_soon_threadsafe``). A stream that ends before its finished delta (client cancelled,
router deadline, worker draining) aborts the request on the backend in ``finally``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Coroutine
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.pdserve.v1 import worker_pb2 as wpb
from protos.pdserve.v1 import worker_pb2_grpc as wpb_grpc
from workers.engine.config import EngineConfig
from workers.netaddr import join_host_port
from workers.service.backend import WorkerBackend
from workers.service.connect import ConnectSession, status_of_submit_error
from workers.token_auth import TokenAuthInterceptor
from workers.wire import TokenDelta, sampling_from_proto

logger = logging.getLogger(__name__)

WORKER_SERVICE = wpb.DESCRIPTOR.services_by_name["Worker"].full_name
# Backend calls (submit, abort, load) run on executor threads: each blocks its thread until the
# step thread takes it, between two steps. A request that finds no free thread waits for the
# step boundary after next: with a fixed 4 threads a worker admitted at most 4 new requests per
# step, and under load, where a step with a 2048-token budget takes seconds on a CPU, TTFT grew
# by whole steps (bench/RESULTS.md, "On a CPU without AVX-512"). One step admits at most the
# engine's max_num_seqs requests: that many threads, plus a few for the router's load polls and
# aborts, let every request that can join the next step wait for it. Idle threads cost nothing.
_SPARE_THREADS = 8


class WorkerServicer(wpb_grpc.WorkerServicer):
    def __init__(
        self,
        worker_id: str,
        backend: WorkerBackend,
        max_num_seqs: int = EngineConfig.max_num_seqs,
    ) -> None:
        """``max_num_seqs``: the engine's, which bounds the requests one step admits."""
        self.worker_id = worker_id
        self.backend = backend
        self.draining = False
        self._executor = ThreadPoolExecutor(
            max_num_seqs + _SPARE_THREADS, thread_name_prefix="worker-call"
        )
        self.num_streams = 0
        self._sessions: set[ConnectSession] = set()

    async def Generate(
        self, request: wpb.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wpb.WorkerGenerateResponse]:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.worker_id} is draining")
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[TokenDelta] = asyncio.Queue()

        def sink(delta: TokenDelta) -> None:
            loop.call_soon_threadsafe(deltas.put_nowait, delta)

        request_id = request.request_id
        try:
            params = sampling_from_proto(request.sampling)
            submit = loop.run_in_executor(
                self._executor,
                self.backend.submit,
                request_id,
                list(request.prompt_token_ids),
                params,
                request.prefill_endpoint,
                sink,
            )
            try:
                # Shielded: the client leaving (cancel, deadline) while the submit waits for
                # the engine's step must not lose track of it; once in, it is aborted.
                await asyncio.shield(submit)
            except asyncio.CancelledError:
                submit.add_done_callback(partial(self._abort_if_submitted, request_id))
                raise
        except Exception as error:
            code = status_of_submit_error(error, request_id)
            await context.abort(code, str(error))
        finished = False
        self.num_streams += 1
        try:
            while not finished:
                delta = await deltas.get()
                finished = delta.finished
                yield wpb.WorkerGenerateResponse(
                    token_ids=delta.token_ids,
                    logprobs=delta.logprobs or (),
                    finish_reason=delta.finish_reason or "",
                    error=delta.error or "",
                    sent_unix_nanos=time.time_ns(),
                )
        finally:
            self.num_streams -= 1
            if not finished:  # the router left (cancel, deadline): free the request's pages
                await loop.run_in_executor(self._executor, self.backend.abort, request_id)

    def _abort_if_submitted(self, request_id: str, submit: asyncio.Future[None]) -> None:
        if not submit.cancelled() and submit.exception() is None:
            self._executor.submit(self.backend.abort, request_id)

    async def Connect(
        self,
        request_iterator: AsyncIterator[wpb.ConnectRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[wpb.ConnectResponse]:
        session = ConnectSession(
            self.backend, self._executor, sampling_from_proto, lambda: self.draining
        )
        self._sessions.add(session)
        try:
            async for response in session.run(request_iterator):
                yield response
        finally:
            self._sessions.discard(session)

    @property
    def num_requests(self) -> int:
        """Requests in flight on this worker (both APIs): what a drain waits for."""
        return self.num_streams + sum(len(s.active) for s in self._sessions)

    async def GetWorkerState(
        self, request: wpb.GetWorkerStateRequest, context: grpc.aio.ServicerContext
    ) -> wpb.GetWorkerStateResponse:
        load = await asyncio.get_running_loop().run_in_executor(self._executor, self.backend.load)
        return wpb.GetWorkerStateResponse(
            worker_id=self.worker_id,
            role=self.backend.role,
            num_running_requests=load.num_running_requests,
            num_waiting_requests=load.num_waiting_requests,
            num_free_kv_pages=load.num_free_kv_pages,
            num_total_kv_pages=load.num_total_kv_pages,
            num_transfers_in_flight=load.num_transfers_in_flight,
            draining=self.draining,
        )

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class WorkerServer:
    """A grpc.aio server for one `WorkerServicer` on an event loop of its own thread.

    Health (``grpc.health.v1``) and reflection are on, as on the router.
    """

    def __init__(
        self,
        servicer: WorkerServicer,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
    ) -> None:
        """``token``: calls but health checks must carry ``authorization: Bearer <token>``
        (`workers.token_auth`); the cluster's secret, which only its router holds."""
        self.servicer = servicer
        self._token = token
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="worker-grpc")
        self._thread.daemon = True
        self._thread.start()
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self.port = self._run(self._start(host, port))
        self.address = join_host_port(host, self.port)

    def _run(self, coroutine: Coroutine[Any, Any, int], timeout: float = 30.0) -> int:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    async def _start(self, host: str, port: int) -> int:
        server = grpc.aio.server(
            interceptors=[TokenAuthInterceptor(self._token)] if self._token else None,
            options=[("grpc.max_concurrent_streams", 4096), ("grpc.so_reuseport", 0)],
        )
        wpb_grpc.add_WorkerServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        names = (WORKER_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        bound = server.add_insecure_port(join_host_port(host, port))
        await server.start()
        await self._health.set(WORKER_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        return bound

    def drain(self, grace: float) -> None:
        """Refuse new requests (UNAVAILABLE) and wait up to ``grace`` for running streams."""
        self.servicer.draining = True

        async def drain() -> int:
            await self._health.enter_graceful_shutdown()
            deadline = time.monotonic() + grace
            while self.servicer.num_requests and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return self.servicer.num_requests

        left = self._run(drain(), timeout=grace + 10)
        if left:
            logger.warning(
                "%s: %d requests still running after %.1f s", self.servicer.worker_id, left, grace
            )

    def stop(self, grace: float = 1.0) -> None:
        async def stop() -> int:
            if self._server is not None:
                await self._server.stop(grace)
            return 0

        try:
            self._run(stop(), timeout=grace + 10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self.servicer.close()
