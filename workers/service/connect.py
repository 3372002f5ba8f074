"""Worker side of ``pdserve.v1.Worker/Connect``: many requests on one long-lived stream.

A session reads ``ConnectRequest``s (start / abort) and writes ``ConnectResponse``s, each with
the deltas of every request that has news (a decode step's tokens of all its requests leave in
one message). Request life cycle on a session::

    generate ─▶ starting (submit on an executor thread) ─▶ running ─▶ finished delta sent
    abort while starting ─▶ aborted as soon as submit returns
    session ends (router gone) ─▶ every starting / running request aborted (one whose submit,
        which no cancel stops, returns after that: again, once it returned)

``active`` (what a drain waits for) holds a request from its start to its finished delta: it
may finish within its submit, before that returns. Aborts run in tasks of their own, so one the
backend fails (closed, its step loop stuck) is logged and the stream goes on.

Backend sinks run on the step thread and only hand deltas to the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import Executor
from functools import partial
from typing import Any

import grpc

from protos.pdserve.v1 import worker_pb2 as wpb
from workers.engine.errors import CapacityError, EngineClosedError, InvalidRequestError
from workers.engine.sampling_params import SamplingParams
from workers.service.backend import WorkerBackend
from workers.wire import TokenDelta

logger = logging.getLogger(__name__)


def status_of_submit_error(error: Exception, request_id: str) -> grpc.StatusCode:
    """The status of request ``request_id`` the backend refused to start (both worker APIs);
    an INTERNAL one (not the client's fault nor a known refusal) is logged with its traceback."""
    code = _submit_error_status(error)
    if code is grpc.StatusCode.INTERNAL:
        logger.error("request %s failed to start", request_id, exc_info=error)
    return code


def _submit_error_status(error: Exception) -> grpc.StatusCode:
    if isinstance(error, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, CapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(error, ValueError):  # the kv worker's duplicate-id check
        return grpc.StatusCode.ALREADY_EXISTS
    if isinstance(error, EngineClosedError):  # stopping or its step loop died: go elsewhere
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


class ConnectSession:
    def __init__(
        self,
        backend: WorkerBackend,
        executor: Executor,
        sampling_from_proto: Callable[[wpb.WorkerSamplingParams], SamplingParams],
        is_draining: Callable[[], bool],
    ) -> None:
        self._backend = backend
        self._executor = executor
        self._sampling = sampling_from_proto
        self._is_draining = is_draining
        self._loop = asyncio.get_running_loop()
        self._outbox: asyncio.Queue[wpb.RequestDelta] = asyncio.Queue()
        self.active: set[str] = set()
        self._starting: set[str] = set()
        self._aborted_early: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(
        self, requests: AsyncIterator[wpb.ConnectRequest]
    ) -> AsyncIterator[wpb.ConnectResponse]:
        reader = asyncio.create_task(self._read(requests))
        try:
            while True:
                deltas = [await self._outbox.get()]
                while not self._outbox.empty():
                    deltas.append(self._outbox.get_nowait())
                for delta in deltas:
                    # A start refused (error_code) never became active; for a duplicate id its
                    # delta names the live request, which must stay tracked (drain, abort).
                    if delta.finish_reason and not delta.error_code:
                        self.active.discard(delta.request_id)
                yield wpb.ConnectResponse(deltas=deltas, sent_unix_nanos=time.time_ns())
        finally:
            reader.cancel()
            for task in list(self._tasks):
                task.cancel()
            left = self.active | self._starting
            self.active.clear()
            for request_id in left:  # the router is gone: free what it left here
                await self._abort_on_backend(request_id)

    async def _read(self, requests: AsyncIterator[wpb.ConnectRequest]) -> None:
        async for request in requests:
            # Both in tasks, in the order they came: a start's task runs first and marks its
            # request starting before an abort of it looks.
            if request.HasField("generate"):
                self._spawn(self._start(request.generate))
            elif request.abort_request_id:
                self._spawn(self._abort(request.abort_request_id))

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _fail(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
        self._outbox.put_nowait(
            wpb.RequestDelta(
                request_id=request_id,
                finish_reason="error",
                error=message,
                error_code=code.value[0],
            )
        )

    async def _start(self, message: wpb.WorkerGenerateRequest) -> None:
        request_id = message.request_id
        if self._is_draining():
            self._fail(request_id, grpc.StatusCode.UNAVAILABLE, "the worker is draining")
            return
        if request_id in self.active or request_id in self._starting:
            self._fail(request_id, grpc.StatusCode.ALREADY_EXISTS, f"{request_id} is in flight")
            return
        outbox, loop = self._outbox, self._loop

        def sink(delta: TokenDelta) -> None:
            proto = wpb.RequestDelta(
                request_id=request_id,
                token_ids=delta.token_ids,
                logprobs=delta.logprobs or (),
                finish_reason=delta.finish_reason or "",
                error=delta.error or "",
            )
            loop.call_soon_threadsafe(outbox.put_nowait, proto)

        self._starting.add(request_id)
        # Active before the submit: the request may finish (and `run` discard it) before the
        # submit returns; added after, it would stay active for good.
        self.active.add(request_id)
        try:
            params = self._sampling(message.sampling)
            submit = loop.run_in_executor(
                self._executor,
                self._backend.submit,
                request_id,
                list(message.prompt_token_ids),
                params,
                message.prefill_endpoint,
                sink,
            )
            try:
                await asyncio.shield(submit)
            except asyncio.CancelledError:
                # The session ended (the router is gone) while the submit ran on its thread,
                # where no cancel stops it: the session's abort may come before the request is
                # in, so abort it again once it is.
                submit.add_done_callback(partial(self._abort_if_submitted, request_id))
                raise
        except Exception as error:
            self.active.discard(request_id)
            code = status_of_submit_error(error, request_id)
            self._fail(request_id, code, str(error))
            return
        finally:
            self._starting.discard(request_id)
        if request_id in self._aborted_early:
            self._aborted_early.discard(request_id)
            await self._abort(request_id)

    def _abort_if_submitted(self, request_id: str, submit: asyncio.Future[None]) -> None:
        if not submit.cancelled() and submit.exception() is None:
            self._spawn(self._abort_on_backend(request_id))

    async def _abort(self, request_id: str) -> None:
        if request_id in self._starting:
            self._aborted_early.add(request_id)
            return
        if request_id in self.active:
            await self._abort_on_backend(request_id)

    async def _abort_on_backend(self, request_id: str) -> None:
        try:
            await self._loop.run_in_executor(self._executor, self._backend.abort, request_id)
        except Exception:  # closed engine, step loop call timed out: the session goes on
            logger.exception("abort of request %s failed", request_id)
