"""Regressions of a request's life cycle between the router and a worker's Connect stream, with
real `WorkerServer`s and a real `Router` over gRPC on loopback; the backends are fakes named
below (tokens, refusals and failures when the test says so).

- a client cancelling while its request is written fails no other request of its worker
- a request started on a closed link goes to another worker (not INTERNAL)
- a request that finishes before its worker's submit returned is not left in flight
- a queued request whose client left is never admitted
- the running-requests gauge after failed admissions
- a request cancelled while the router releases its lost worker's slot releases it once
- an abort the backend fails is logged and the worker's stream goes on
- a request whose submit returns after its router left is aborted
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence

import pytest
from prometheus_client import CollectorRegistry

from orchestrator.errors import QueueFullError, UnavailableError
from orchestrator.registry import Registry, WorkerRecord
from orchestrator.router import GenerationInput, Router, RouterSettings
from orchestrator.worker_backend import Sink, client_request_id
from orchestrator.worker_link import LinkBroken, WorkerLink
from protos.pdserve.v1 import worker_pb2 as wpb
from tests.orchestrator.cluster_helpers import wait_until_async
from tests.orchestrator.test_router_reroute import Servers, _collect
from tests.orchestrator.test_router_reroute import _router as _round_robin_router
from tests.orchestrator.test_router_units import FakeBackend, _next, _router
from workers.engine.errors import EngineClosedError
from workers.engine.sampling_params import SamplingParams
from workers.engine.tokenizer import ByteTokenizer
from workers.metrics import Metrics

# Bounds the waits for what a bug prevents (a test fails then, rather than hangs).
BUG_BOUND = 10.0


@pytest.fixture
def servers() -> Iterator[Servers]:
    started = Servers()
    yield started
    for server in started.running:
        server.stop(0.1)


class FinishingBackend(FakeBackend):
    """Fake, named: ends each request within its submit (as a decode worker may, the request
    finishing in the step that took it in); ``release`` holds the submit's return."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.release.set()

    def submit(
        self, request_id: str, prompt: Sequence[int], params: SamplingParams, ep: bytes, sink: Sink
    ) -> None:
        super().submit(request_id, prompt, params, ep, sink)
        self.emit(client_request_id(request_id), ord("a"), "length")
        self.release.wait(BUG_BOUND)


class CueBackend(FakeBackend):
    """Fake, named: says when a submit began (``entered``); refuses the requests named
    ``refused*`` as unavailable once ``gate`` opens; fails its next ``num_aborts_to_fail``
    aborts as a closed engine does."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.num_aborts_to_fail = 0
        self.num_failed_aborts = 0

    def submit(
        self, request_id: str, prompt: Sequence[int], params: SamplingParams, ep: bytes, sink: Sink
    ) -> None:
        self.entered.set()
        if client_request_id(request_id).startswith("refused"):
            self.gate.wait(BUG_BOUND)
            raise EngineClosedError("the engine's step loop died")
        super().submit(request_id, prompt, params, ep, sink)

    def abort(self, request_id: str) -> None:
        with self.lock:
            fail = self.num_failed_aborts < self.num_aborts_to_fail
            self.num_failed_aborts += fail
        if fail:
            raise EngineClosedError("the engine is closed")
        super().abort(request_id)


# --- a client cancelling while its request is written ---------------------------------------


def test_a_cancel_while_a_request_is_written_fails_no_other_request(servers: Servers) -> None:
    """grpc.aio cancels a whole stream-stream call when a task is cancelled inside its
    ``write``; the Connect stream carries every request of the worker. Each round cancels a
    request one more loop turn later, through its admission and write, while a bystander
    streams on the same worker; the bystander ends normally, and every cancelled request that
    reached the worker is aborted there (its abort came after its ``generate``)."""
    backend = FakeBackend()
    address = servers.start(backend, "decode-0")

    async def run() -> None:
        router = _router(address)
        for turns in range(40):
            bystander = router.generate(GenerationInput(f"stay{turns}", "hi"))
            first = asyncio.create_task(_next(bystander))
            await wait_until_async(lambda n=f"stay{turns}": n in backend.sinks, BUG_BOUND)  # type: ignore[misc]
            backend.emit(f"stay{turns}", ord("x"))
            await first
            leaving = router.generate(GenerationInput(f"leave{turns}", "hi"))
            task = asyncio.create_task(_next(leaving))
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


# --- a closed link ---------------------------------------------------------------------------


def test_a_request_started_on_a_closed_link_goes_to_another_worker(servers: Servers) -> None:
    """A link the router closed (worker down or replaced) can still be in a request's hands
    (its prefill retry reuses it). Its channel refuses a new call: that is a broken link, so
    the request is rerouted, not failed as INTERNAL."""
    backends = [FinishingBackend(), FinishingBackend()]
    addresses = [servers.start(b, f"decode-{i}") for i, b in enumerate(backends)]

    async def run() -> None:
        link = WorkerLink(addresses[0])
        await link.start(wpb.WorkerGenerateRequest(request_id="a#1", prompt_token_ids=[1]))
        await link.close()
        assert link._reader is not None
        await link._reader  # it saw the stream end
        with pytest.raises(LinkBroken, match="closed"):
            await link.start(wpb.WorkerGenerateRequest(request_id="a#2", prompt_token_ids=[1]))

        router = _round_robin_router(addresses)
        for request_id in ("warm0", "warm1"):  # round robin: decode-0, then decode-1
            assert (await _collect(router, request_id))[-1].finish_reason == "length"
        closed = router._links["decode-0"]
        await closed.close()
        assert closed._reader is not None
        await closed._reader
        events = await _collect(router, "moved")  # round robin: decode-0, closed
        assert events[-1].finish_reason == "length"
        assert [client_request_id(i) for i in backends[1].worker_request_ids] == [
            "warm1",
            "moved",
        ]
        assert router._is_suspect(router.registry.workers["decode-0"])
        await router.close()

    asyncio.run(run())


# --- a request that finishes within its submit -----------------------------------------------


def test_a_request_finished_before_its_submit_returned_is_not_left_in_flight(
    servers: Servers,
) -> None:
    """Its finished delta passes the worker's stream before the submit returns (the submit is
    held until the router saw it); the worker must not count it in flight after, or a drain
    waits its whole grace period for it."""
    backend = FinishingBackend()
    address = servers.start(backend, "decode-0")
    servicer = servers.running[0].servicer

    async def run() -> None:
        router = _router(address)
        backend.release.clear()
        assert (await _collect(router, "quick"))[-1].finish_reason == "length"
        backend.release.set()
        (session,) = servicer._sessions
        await wait_until_async(lambda: not session._starting, BUG_BOUND)  # its start is over
        assert servicer.num_requests == 0
        await router.close()

    asyncio.run(run())


# --- a queued request whose client left --------------------------------------------------------


def test_a_queued_request_cancelled_as_its_wait_ends_is_not_admitted(servers: Servers) -> None:
    """One slot: a holder ends and wakes the queued request; its client leaves one more loop
    turn later each round. On Python 3.11 ``wait_for`` dropped a cancel landing as the wait
    completed: the request was admitted and ran for nobody (its task never ended)."""
    backend = FakeBackend()
    address = servers.start(backend, "decode-0")

    async def run() -> None:
        router = _router(address, capacity=1, max_queue=1)
        for turns in range(8):
            holder = router.generate(GenerationInput(f"hold{turns}", "hi"))
            first = asyncio.create_task(_next(holder))
            await wait_until_async(lambda n=f"hold{turns}": n in backend.sinks, BUG_BOUND)  # type: ignore[misc]
            backend.emit(f"hold{turns}", ord("x"), "length")
            await first
            queued = router.generate(GenerationInput(f"queued{turns}", "hi"))
            task = asyncio.create_task(_next(queued))
            await wait_until_async(lambda: router.num_queued == 1, BUG_BOUND)
            await holder.aclose()  # releases the slot: the queued request is woken
            for _ in range(turns):
                await asyncio.sleep(0)
            task.cancel()
            await wait_until_async(task.done, BUG_BOUND)
            assert task.cancelled(), turns
            await queued.aclose()
            assert router.num_outstanding == 0
        await router.close()

    asyncio.run(run())


# --- the running-requests gauge ---------------------------------------------------------------


def _gauges(registry: CollectorRegistry) -> tuple[float | None, float | None]:
    labels = {"role": "router", "model": "m"}
    return (
        registry.get_sample_value("pdserve_num_requests_running", labels),
        registry.get_sample_value("pdserve_num_requests_waiting", labels),
    )


def test_the_running_gauge_counts_no_request_whose_admission_failed(servers: Servers) -> None:
    backend = FakeBackend()
    address = servers.start(backend, "decode-0")
    registry = CollectorRegistry()

    async def run() -> None:
        workers = Registry()
        workers.add(WorkerRecord("decode-0", "decode", 0, health="healthy", address=address))
        settings = RouterSettings(
            "decode", False, 512, 64, 1024, capacity_per_worker=1, max_queue=1,
            default_max_tokens=8,
        )  # fmt: skip
        metrics = Metrics(registry, role="router", model="m")
        router = Router(settings, workers, ByteTokenizer(), metrics)
        holder = router.generate(GenerationInput("holder", "hi"))
        first = asyncio.create_task(_next(holder))
        await wait_until_async(lambda: "holder" in backend.sinks, BUG_BOUND)
        backend.emit("holder", ord("x"))
        await first
        queued = asyncio.create_task(_next(router.generate(GenerationInput("queued", "hi"))))
        await wait_until_async(lambda: router.num_queued == 1, BUG_BOUND)
        with pytest.raises(QueueFullError):
            await anext(router.generate(GenerationInput("refused", "hi")))
        assert _gauges(registry) == (1, 1)
        queued.cancel()  # its client left the queue
        await asyncio.gather(queued, return_exceptions=True)
        assert _gauges(registry) == (1, 0)
        await holder.aclose()
        workers.set_health("decode-0", "unhealthy")
        with pytest.raises(UnavailableError):
            await anext(router.generate(GenerationInput("nowhere", "hi")))
        assert _gauges(registry) == (0, 0)
        await router.close()

    asyncio.run(run())


# --- a cancel while a lost worker's slot is released ---------------------------------------------


def test_a_request_cancelled_while_releasing_its_lost_workers_slot_releases_it_once(
    servers: Servers,
) -> None:
    """decode-0 refuses a request as unavailable; the router releases its slot there to
    reroute it, and waits for its queue's lock (the test holds it, as a queued request taking
    it back after its wait does). The client leaves then: the slot is not released again,
    which would free the slot of another request on decode-0."""
    cue, other = CueBackend(), FakeBackend()
    addresses = [servers.start(cue, "decode-0"), servers.start(other, "decode-1")]

    async def run() -> None:
        router = _round_robin_router(addresses)
        holders = [router.generate(GenerationInput(f"hold{i}", "x")) for i in range(2)]
        firsts = [asyncio.create_task(_next(h)) for h in holders]  # decode-0, decode-1
        await wait_until_async(lambda: "hold0" in cue.sinks and "hold1" in other.sinks)
        cue.entered.clear()
        refused = router.generate(GenerationInput("refused", "x"))  # decode-0
        task = asyncio.create_task(_next(refused))
        await wait_until_async(cue.entered.is_set, BUG_BOUND)
        await router._room.acquire()
        try:
            cue.gate.set()
            # Its slot is released; the router waits for the lock to wake the queue.
            await wait_until_async(lambda: router._outstanding["decode-0"] == 1, BUG_BOUND)
            task.cancel()  # lands in that wait
        finally:
            router._room.release()
        await asyncio.gather(task, return_exceptions=True)
        await refused.aclose()
        assert router._outstanding == {"decode-0": 1, "decode-1": 1}  # the holders'
        for task in firsts:
            task.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)
        for holder in holders:
            await holder.aclose()
        await router.close()

    asyncio.run(run())


# --- the worker's side of a stream --------------------------------------------------------------


def test_an_abort_the_backend_fails_is_logged_and_the_stream_goes_on(
    servers: Servers, caplog: pytest.LogCaptureFixture
) -> None:
    backend = CueBackend()
    backend.num_aborts_to_fail = 1
    address = servers.start(backend, "decode-0")

    async def run() -> None:
        router = _router(address)
        left = router.generate(GenerationInput("left", "hi"))
        first = asyncio.create_task(_next(left))
        await wait_until_async(lambda: "left" in backend.sinks, BUG_BOUND)
        backend.emit("left", ord("x"))
        await first
        await left.aclose()  # the router aborts it; the backend fails that abort
        await wait_until_async(lambda: backend.num_failed_aborts == 1, BUG_BOUND)
        task = asyncio.create_task(_collect(router, "next"))  # on the same stream
        await wait_until_async(lambda: "next" in backend.sinks, BUG_BOUND)
        backend.emit("next", ord("y"), "length")
        assert (await task)[-1].finish_reason == "length"
        await router.close()

    with caplog.at_level(logging.ERROR):
        asyncio.run(run())
    assert any("abort of request left#" in r.getMessage() for r in caplog.records)


def test_a_request_whose_submit_returns_after_its_router_left_is_aborted(
    servers: Servers,
) -> None:
    """The submit runs on an executor thread no cancel stops; the session's abort on its end
    comes before the request is in, and would leave it running to max_tokens for nobody."""
    backend = CueBackend()
    address = servers.start(backend, "decode-0")

    async def run() -> None:
        router = _router(address)
        backend.hold_submit.clear()
        task = asyncio.create_task(_next(router.generate(GenerationInput("orphan", "hi"))))
        await wait_until_async(backend.entered.is_set, BUG_BOUND)
        await router.close()  # the Connect stream ends while the submit is held
        await wait_until_async(lambda: "orphan" in backend.aborted, BUG_BOUND)
        backend.hold_submit.set()
        await wait_until_async(lambda: backend.worker_request_ids != [], BUG_BOUND)
        await wait_until_async(lambda: "orphan" not in backend.sinks, BUG_BOUND)
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
