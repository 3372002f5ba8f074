"""The worker's side of the Connect stream (`workers.service.connect`), driven by a real
`Router` over gRPC on loopback; the backends are the fakes of `tests.fakes`: a request that
finishes within its submit, an abort the backend fails, a submit that returns after the router
left."""

from __future__ import annotations

import asyncio
import logging

import pytest

from orchestrator.router.types import GenerationInput
from tests.fakes import FakeBackend, FakeFailingAbortBackend, FakeFinishingBackend
from tests.orchestrator.harness import BUG_BOUND, Servers, collect, decode_router, next_event
from tests.waiting import wait_until_async


def test_a_request_finished_before_its_submit_returned_is_not_left_in_flight(
    worker_servers: Servers,
) -> None:
    """Its finished delta passes the worker's stream before the submit returns (the submit is
    held until the router saw it); the worker must not count it in flight after, or a drain
    waits its whole grace period for it."""
    backend = FakeFinishingBackend()
    address = worker_servers.start(backend, "decode-0")
    servicer = worker_servers.running[0].servicer

    async def run() -> None:
        router = decode_router(address)
        backend.release.clear()
        assert (await collect(router, "quick"))[-1].finish_reason == "length"
        backend.release.set()
        (session,) = servicer._sessions
        await wait_until_async(lambda: not session._starting, BUG_BOUND)  # its start is over
        assert servicer.num_requests == 0
        await router.close()

    asyncio.run(run())


def test_an_abort_the_backend_fails_is_logged_and_the_stream_goes_on(
    worker_servers: Servers, caplog: pytest.LogCaptureFixture
) -> None:
    backend = FakeFailingAbortBackend(num_aborts_to_fail=1)
    address = worker_servers.start(backend, "decode-0")

    async def run() -> None:
        router = decode_router(address)
        left = router.generate(GenerationInput("left", "hi"))
        first = asyncio.create_task(next_event(left))
        await wait_until_async(lambda: "left" in backend.sinks, BUG_BOUND)
        backend.emit("left", ord("x"))
        await first
        await left.aclose()  # the router aborts it; the backend fails that abort
        await wait_until_async(lambda: backend.num_failed_aborts == 1, BUG_BOUND)
        task = asyncio.create_task(collect(router, "next"))  # on the same stream
        await wait_until_async(lambda: "next" in backend.sinks, BUG_BOUND)
        backend.emit("next", ord("y"), "length")
        assert (await task)[-1].finish_reason == "length"
        await router.close()

    with caplog.at_level(logging.ERROR):
        asyncio.run(run())
    assert any("abort of request left#" in r.getMessage() for r in caplog.records)


def test_a_request_whose_submit_returns_after_its_router_left_is_aborted(
    worker_servers: Servers,
) -> None:
    """The submit runs on an executor thread no cancel stops; the session's abort on its end
    comes before the request is in, and would leave it running to max_tokens for nobody."""
    backend = FakeBackend()
    address = worker_servers.start(backend, "decode-0")

    async def run() -> None:
        router = decode_router(address)
        backend.hold_submit.clear()
        task = asyncio.create_task(next_event(router.generate(GenerationInput("orphan", "hi"))))
        await wait_until_async(backend.entered.is_set, BUG_BOUND)
        await router.close()  # the Connect stream ends while the submit is held
        await wait_until_async(lambda: "orphan" in backend.aborted, BUG_BOUND)
        backend.hold_submit.set()
        await wait_until_async(lambda: backend.worker_request_ids != [], BUG_BOUND)
        await wait_until_async(lambda: "orphan" not in backend.sinks, BUG_BOUND)
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
