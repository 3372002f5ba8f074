"""The token path between a real `Router` and real `WorkerServer`s over the Connect stream on
loopback (`WorkerLink`): tokens as text, aborts on every way a request ends early, worker
request ids unique per attempt, and the link's failures (a cancel mid-write, a closed link, a
stream that already ended, a worker taken out of service). The backends are the fakes of
`tests.fakes` (tokens when the test says), except for the reused request id, which runs the
tiny preset's engine."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchestrator.api.servicer import status_of
from orchestrator.errors import UnavailableError, WorkerFailedError
from orchestrator.router.types import GenerationInput
from orchestrator.router.worker_link import LinkBroken, WorkerLink
from protos.pdserve.v1 import worker_pb2 as wpb
from tests.fakes import FakeBackend, FakeFinishingBackend
from tests.orchestrator.harness import (
    BUG_BOUND,
    GREEDY,
    Servers,
    collect,
    decode_router,
    engine_idle,
    mixed_router,
    next_event,
    round_robin_router,
)
from tests.waiting import wait_until_async
from workers.service.backend import MixedBackend
from workers.service.server import WorkerServer, WorkerServicer
from workers.wire import client_request_id


def test_tokens_stream_through_the_router_as_text(worker: Any) -> None:
    backend, server = worker

    async def run() -> None:
        router = decode_router(server.address)
        stream = router.generate(GenerationInput(request_id="r1", prompt="hi"))
        first = asyncio.create_task(next_event(stream))
        await wait_until_async(lambda: "r1" in backend.sinks, 4.0)
        backend.emit("r1", ord("o"))
        assert (await first).text == "o"
        backend.emit("r1", ord("k"), "length")
        last = await anext(stream)
        assert last.text == "k" and last.finish_reason == "length"
        assert last.num_completion_tokens == 2 and last.timings is not None
        await router.close()

    asyncio.run(run())


def test_abort_while_starting_and_when_the_router_leaves(worker: Any) -> None:
    backend, server = worker

    async def run() -> None:
        router = decode_router(server.address)
        backend.hold_submit.clear()
        early = router.generate(GenerationInput(request_id="early", prompt="x"))
        task = asyncio.create_task(next_event(early))
        await wait_until_async(backend.entered.is_set, 4.0)  # its submit is held
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await early.aclose()
        backend.hold_submit.set()  # submit completes after the abort arrived
        await wait_until_async(lambda: "early" in backend.aborted, 4.0)

        left = router.generate(GenerationInput(request_id="left", prompt="x"))
        task = asyncio.create_task(next_event(left))
        await wait_until_async(lambda: "left" in backend.sinks, 4.0)
        await router.close()  # the Connect stream ends: the worker aborts what it carried
        await wait_until_async(lambda: "left" in backend.aborted, 4.0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())


def test_unavailable_without_ready_workers_and_worker_down(worker: Any) -> None:
    backend, server = worker

    async def run() -> None:
        router = decode_router(server.address)
        stream = router.generate(GenerationInput(request_id="doomed", prompt="x"))
        task = asyncio.create_task(next_event(stream))
        await wait_until_async(lambda: "doomed" in backend.sinks, 4.0)
        router.registry.set_health("decode-0", "unhealthy")
        with pytest.raises(WorkerFailedError):
            await task
        with pytest.raises(UnavailableError):
            await anext(router.generate(GenerationInput(prompt="x")))
        await router.close()

    asyncio.run(run())


def test_a_cancel_while_a_request_is_written_fails_no_other_request(
    worker_servers: Servers,
) -> None:
    """grpc.aio cancels a whole stream-stream call when a task is cancelled inside its
    ``write``; the Connect stream carries every request of the worker. Each round cancels a
    request one more loop turn later, through its admission and write, while a bystander
    streams on the same worker; the bystander ends normally, and every cancelled request that
    reached the worker is aborted there (its abort came after its ``generate``)."""
    backend = FakeBackend()
    address = worker_servers.start(backend, "decode-0")

    async def run() -> None:
        router = decode_router(address)
        for turns in range(40):
            bystander = router.generate(GenerationInput(f"stay{turns}", "hi"))
            first = asyncio.create_task(next_event(bystander))
            await wait_until_async(lambda n=f"stay{turns}": n in backend.sinks, BUG_BOUND)  # type: ignore[misc]
            backend.emit(f"stay{turns}", ord("x"))
            await first
            leaving = router.generate(GenerationInput(f"leave{turns}", "hi"))
            task = asyncio.create_task(next_event(leaving))
            for _ in range(turns):
                await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await leaving.aclose()
            with contextlib.suppress(KeyError):  # gone if the worker lost its stream
                backend.emit(f"stay{turns}", ord("y"), "length")
            assert (await anext(bystander)).finish_reason == "length", turns
            await bystander.aclose()
        await wait_until_async(
            lambda: not [r for r in backend.sinks if r.startswith("leave")], BUG_BOUND
        )
        await router.close()

    asyncio.run(run())


def test_a_request_started_on_a_closed_link_goes_to_another_worker(worker_servers: Servers) -> None:
    """A link the router closed (worker down or replaced) can still be in a request's hands
    (its prefill retry reuses it). Its channel refuses a new call: that is a broken link, so
    the request is rerouted, not failed as INTERNAL."""
    backends = [FakeFinishingBackend(), FakeFinishingBackend()]
    addresses = [worker_servers.start(b, f"decode-{i}") for i, b in enumerate(backends)]

    async def run() -> None:
        link = WorkerLink(addresses[0])
        await link.start(wpb.WorkerGenerateRequest(request_id="a#1", prompt_token_ids=[1]))
        await link.close()
        assert link._reader is not None
        await link._reader  # it saw the stream end
        with pytest.raises(LinkBroken, match="closed"):
            await link.start(wpb.WorkerGenerateRequest(request_id="a#2", prompt_token_ids=[1]))

        router = round_robin_router(addresses)
        for request_id in ("warm0", "warm1"):  # round robin: decode-0, then decode-1
            assert (await collect(router, request_id))[-1].finish_reason == "length"
        closed = router._links["decode-0"]
        await closed.close()
        assert closed._reader is not None
        await closed._reader
        events = await collect(router, "moved")  # round robin: decode-0, closed
        assert events[-1].finish_reason == "length"
        assert [client_request_id(i) for i in backends[1].worker_request_ids] == [
            "warm1",
            "moved",
        ]
        assert router.suspects.is_suspect(router.registry.workers["decode-0"])
        await router.close()

    asyncio.run(run())


def test_a_request_sent_on_a_stream_that_already_ended_is_unavailable() -> None:
    """Between the end of a worker's Connect stream and the moment the link's reader task sees
    it, a request still goes out on that stream. The worker dying makes that window, but not
    on demand: here the stream is ended by cancelling it (a real call, really finished) in the
    same event-loop turn as the next request, so that request always lands in the window."""
    backend = FakeBackend()
    server = WorkerServer(WorkerServicer("decode-0", backend))

    async def run() -> None:
        router = decode_router(server.address)
        first = router.generate(GenerationInput("first", "x"))
        task = asyncio.create_task(next_event(first))
        await wait_until_async(lambda: "first" in backend.sinks, 4.0)
        backend.emit("first", ord("k"), "length")
        assert (await task).finish_reason == "length"
        await first.aclose()
        link = router._links["decode-0"]
        call = link._call
        assert call is not None
        call.cancel()  # the stream ended; the reader has not run since
        with pytest.raises(WorkerFailedError) as failed:
            await anext(router.generate(GenerationInput("late", "x")))
        assert status_of(failed.value) is grpc.StatusCode.UNAVAILABLE
        assert link._queues == {}  # nothing left waiting on the dead stream
        assert router.suspects.is_suspect(router.registry.workers["decode-0"])  # not chosen again
        await router.close()

    try:
        asyncio.run(run())
    finally:
        server.stop(0.1)


def test_a_request_id_reused_right_after_a_cancel_serves_the_new_request(
    mixed_worker: tuple[MixedBackend, WorkerServer], tiny_model_dir: Path
) -> None:
    """The old request's abort is sent in the background when its stream closes; the new one
    with the same client id goes out at once. Workers know each by its own worker request id,
    so the abort ends the old one only, and the new one streams to its end under the client's
    id."""
    backend, server = mixed_worker

    async def run() -> list[tuple[str, int, int]]:
        router = mixed_router(tiny_model_dir, server.address)
        ends = []
        for trial in range(4):
            request_id = f"again-{trial}"
            old = router.generate(
                GenerationInput(request_id, "hello world", sampling=GREEDY, max_tokens=400)
            )
            for _ in range(3):
                await anext(old)
            await old.aclose()  # the client cancelled: the router aborts it on the worker
            assert router.num_outstanding == 0  # the id is free again
            new = router.generate(
                GenerationInput(
                    request_id,
                    "hello world",
                    sampling=GREEDY,
                    max_tokens=40,
                    return_token_ids=True,
                )
            )
            events = [event async for event in new]
            assert {event.request_id for event in events} == {request_id}
            last = events[-1]
            num_ids = sum(len(event.token_ids) for event in events)
            ends.append((last.finish_reason, last.num_completion_tokens, num_ids))
        await engine_idle(backend)  # nothing left running for nobody
        await router.close()
        return ends

    assert asyncio.run(run()) == [("length", 40, 40)] * 4
