"""Router side of ``pdserve.v1.Worker/Connect``: one long-lived stream per worker, many requests.

`WorkerLink.start` writes one ``generate`` message and returns the request's queue of
``RequestDelta``s; a reader task routes each delta of each ``ConnectResponse`` to its queue by
its request id (the router's worker request id, unique per attempt: never a client's own id,
which a client may reuse while the worker still runs the old request).
`WorkerLink.abort` writes an ``abort`` message (fire and forget: it runs from ``finally`` blocks
of cancelled tasks). When the stream breaks (worker died, network), every open queue receives a
`LinkBroken` and the next `start` opens a new stream.

Every write runs in a task of the link's own (`_send`), never in a request's task: grpc.aio
cancels the whole call when a task is cancelled inside ``write``, and the call is the stream
of every request on the worker. Writes go out in the order they were sent (a FIFO lock), so an
abort sent after a cancelled request's ``generate`` reaches the worker after it.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from orchestrator.api.security import token_interceptors
from protos.pdserve.v1 import worker_pb2 as wpb
from protos.pdserve.v1 import worker_pb2_grpc as wpb_grpc

logger = logging.getLogger(__name__)


class LinkBroken(Exception):
    """The Connect stream to the worker ended while requests were open on it."""


DeltaQueue = asyncio.Queue[wpb.RequestDelta | LinkBroken]


class WorkerLink:
    def __init__(self, address: str, token: str | None = None) -> None:
        """``token``: the cluster's secret, which the worker's service asks of every call."""
        self.address = address
        self._channel = grpc.aio.insecure_channel(
            address, interceptors=token_interceptors(token) if token else None
        )
        self._stub = wpb_grpc.WorkerStub(self._channel)
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task[None] | None = None
        self._queues: dict[str, DeltaQueue] = {}
        self._write_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, message: wpb.WorkerGenerateRequest) -> DeltaQueue:
        queue: DeltaQueue = asyncio.Queue()
        try:
            call = self._connect()  # a closed link's channel refuses a new call (UsageError)
            self._queues[message.request_id] = queue
            # Shielded: the request's task cancelled here (its client left) must not cancel the
            # write, and so the stream; the write goes on and the caller's abort follows it.
            await asyncio.shield(self._send(call, wpb.ConnectRequest(generate=message)))
        except (
            grpc.aio.AioRpcError,
            grpc.aio.UsageError,
            # The call already finished (its worker died) and the reader has not cleared it yet.
            asyncio.InvalidStateError,
        ) as error:
            self._queues.pop(message.request_id, None)
            raise LinkBroken(f"{self.address}: {error}") from None
        return queue

    def abort(self, request_id: str) -> None:
        """Stop routing ``request_id`` and ask the worker to abort it (in the background)."""
        if self._queues.pop(request_id, None) is None or self._call is None:
            return
        self._send(self._call, wpb.ConnectRequest(abort_request_id=request_id))

    def forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def fail(self, request_id: str, reason: str) -> None:
        queue = self._queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(LinkBroken(reason))

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        await self._channel.close()

    def _connect(self) -> grpc.aio.StreamStreamCall:
        if self._call is None:
            self._call = call = self._stub.Connect()
            self._reader = asyncio.get_running_loop().create_task(self._read(call))
        return self._call

    def _send(
        self, call: grpc.aio.StreamStreamCall, message: wpb.ConnectRequest
    ) -> asyncio.Task[None]:
        """Write ``message`` on ``call`` in a task of the link's own (kept until done)."""
        task = asyncio.get_running_loop().create_task(self._write(call, message))
        self._tasks.add(task)
        task.add_done_callback(self._written)
        return task

    async def _write(self, call: grpc.aio.StreamStreamCall, message: wpb.ConnectRequest) -> None:
        async with self._write_lock:  # asyncio.Lock is FIFO: writes keep the order of `_send`
            await call.write(message)

    def _written(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            # Retrieved, not raised: a failed write means the stream is gone, which the reader
            # reports to every open request (and the worker aborts everything it carried).
            task.exception()

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        reason = "stream closed"
        try:
            async for response in call:
                for delta in response.deltas:
                    queue = self._queues.get(delta.request_id)
                    if queue is None:
                        continue
                    if delta.finish_reason:
                        del self._queues[delta.request_id]
                    queue.put_nowait(delta)
        except grpc.aio.AioRpcError as error:
            reason = f"{error.code().name}: {error.details()}"
        except asyncio.CancelledError:
            reason = "link closed"
        finally:
            if self._call is call:
                self._call = None
            broken, self._queues = self._queues, {}
            for queue in broken.values():
                queue.put_nowait(LinkBroken(f"{self.address}: {reason}"))
            if broken:
                logger.warning(
                    "link to %s broke with %d requests open: %s", self.address, len(broken), reason
                )
