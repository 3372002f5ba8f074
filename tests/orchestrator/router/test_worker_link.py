"""The router's parts without Ray: text stream, policy, proto mapping, and the Connect token path
between a real `WorkerServer` (fake backend) and a real `Router` over gRPC on loopback."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from orchestrator.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    QueueFullError,
    UnavailableError,
    WorkerFailedError,
)
from orchestrator.policy import LeastOutstanding, PrefillLoad, create_policy
from orchestrator.registry import Registry, WorkerRecord
from orchestrator.router import (
    GenerationInput,
    Router,
    RouterSettings,
    StreamEvent,
)
from orchestrator.servicer import input_from_proto, status_of
from orchestrator.text_stream import TextStream
from orchestrator.worker_backend import Sink, TokenDelta, WorkerLoad, client_request_id
from orchestrator.worker_service import WorkerServer, WorkerServicer
from protos.pdserve.v1 import generation_pb2 as pb
from tests.orchestrator.cluster_helpers import wait_until_async
from workers.engine.sampling_params import SamplingParams
from workers.engine.tokenizer import ByteTokenizer
from workers.metrics import Metrics

# --- text stream -----------------------------------------------------------------------------


def _push_text(stream: TextStream, text: str) -> str:
    out = ""
    for byte in text.encode():
        stream.push(byte)
        out += stream.take()
    return out + stream.take(final=True)


def test_text_stream_without_stop_strings_passes_everything() -> None:
    assert _push_text(TextStream(ByteTokenizer(), [1, 2], []), "héllo wörld") == "héllo wörld"


def test_text_stream_cuts_at_the_earliest_stop_string_and_holds_back_its_prefix() -> None:
    stream = TextStream(ByteTokenizer(), [1], ["END", "xy"])
    sent = ""
    for byte in b"abcEN":
        stream.push(byte)
        sent += stream.take()
    assert sent == "abc"  # "EN" is held back: it may start "END"
    stream.push(ord("D"))
    assert stream.stopped and stream.take() == ""
    assert stream.text == "abc"


def test_text_stream_releases_held_text_at_the_end() -> None:
    assert _push_text(TextStream(ByteTokenizer(), [1], ["END"]), "abcEN") == "abcEN"


# --- policy and mapping ----------------------------------------------------------------------


def _record(worker_id: str, address: str = "") -> WorkerRecord:
    return WorkerRecord(worker_id, "decode", 0, health="healthy", address=address)


def test_least_outstanding_picks_the_least_loaded() -> None:
    workers = [_record("a"), _record("b"), _record("c")]
    policy = LeastOutstanding(seed=0)
    assert policy.pick(workers, {"a": 3, "b": 1, "c": 2}).worker_id == "b"
    picked = {policy.pick(workers, {}).worker_id for _ in range(50)}
    assert picked == {"a", "b", "c"}  # ties are spread
    with pytest.raises(ValueError):
        create_policy("fastest")


def test_prefill_load_picks_the_fewest_tokens_in_flight_and_releases_them() -> None:
    workers = [_record("p0"), _record("p1")]
    load = PrefillLoad(seed=0)
    first = load.pick(workers, 1000).worker_id
    other = "p1" if first == "p0" else "p0"
    # Three short prompts together weigh less than the long one: all go to the other worker.
    assert [load.pick(workers, 100).worker_id for _ in range(3)] == [other] * 3
    assert (load.tokens(first), load.tokens(other)) == (1000, 300)
    load.release(first, 1000)
    assert load.pick(workers, 50).worker_id == first
    load.release(first, 50)
    for _ in range(3):
        load.release(other, 100)
    assert load.tokens("p0") == load.tokens("p1") == 0
    picked = {load.pick(workers, 0).worker_id for _ in range(50)}
    assert picked == {"p0", "p1"}  # ties are spread


def test_input_from_proto_keeps_presence() -> None:
    unset = input_from_proto(pb.GenerateRequest(prompt="x"))
    assert unset.sampling == {} and unset.max_tokens is None
    given = input_from_proto(
        pb.GenerateRequest(
            prompt="x", sampling=pb.SamplingParams(temperature=0, max_tokens=3, seed=7)
        )
    )
    assert given.sampling["temperature"] == 0 and given.sampling["seed"] == 7
    assert given.max_tokens == 3
    with pytest.raises(InvalidRequestError):
        input_from_proto(pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(max_tokens=0)))


def test_status_mapping() -> None:
    assert status_of(InvalidRequestError()) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(QueueFullError()) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_of(UnavailableError()) == grpc.StatusCode.UNAVAILABLE
    assert status_of(WorkerFailedError()) == grpc.StatusCode.UNAVAILABLE
    assert status_of(DuplicateRequestError()) == grpc.StatusCode.ALREADY_EXISTS
    assert status_of(RuntimeError()) == grpc.StatusCode.INTERNAL


# --- the Connect token path with a fake backend ----------------------------------------------


class FakeBackend:
    """Tokens only when the test says so; records aborts; can hold submits.

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
        self.lock = threading.Lock()

    def submit(
        self, request_id: str, prompt: Sequence[int], params: SamplingParams, _: bytes, sink: Sink
    ) -> None:
        if prompt[0] == 0:
            raise InvalidRequestError("token 0 is refused by this fake")
        self.hold_submit.wait(10)
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

    def prefill_endpoint(self) -> bytes:
        return b""

    def close(self) -> None:
        pass


@pytest.fixture
def worker() -> Any:
    backend = FakeBackend()
    server = WorkerServer(WorkerServicer("decode-0", backend))
    try:
        yield backend, server
    finally:
        server.stop(0.1)


def _router(address: str, capacity: int = 4, max_queue: int = 1) -> Router:
    registry = Registry()
    registry.add(_record("decode-0", address))
    settings = RouterSettings(
        serving_role="decode",
        is_disaggregated=False,
        vocab_size=512,
        max_model_len=64,
        pool_tokens=1024,
        capacity_per_worker=capacity,
        max_queue=max_queue,
        default_max_tokens=8,
    )
    return Router(settings, registry, ByteTokenizer())


async def _next(stream: AsyncGenerator[StreamEvent, None]) -> StreamEvent:
    return await anext(stream)


def test_tokens_stream_through_the_router_as_text(worker: Any) -> None:
    backend, server = worker

    async def run() -> None:
        router = _router(server.address)
        stream = router.generate(GenerationInput(request_id="r1", prompt="hi"))
        first = asyncio.create_task(_next(stream))
        await wait_until_async(lambda: "r1" in backend.sinks, 4.0)
        backend.emit("r1", ord("o"))
        assert (await first).text == "o"
        backend.emit("r1", ord("k"), "length")
        last = await anext(stream)
        assert last.text == "k" and last.finish_reason == "length"
        assert last.num_completion_tokens == 2 and last.timings is not None
        await router.close()

    asyncio.run(run())


def test_bad_requests_queue_full_and_duplicates(worker: Any) -> None:
    backend, server = worker

    async def run() -> None:
        router = _router(server.address, capacity=1, max_queue=1)
        with pytest.raises(InvalidRequestError):  # rejected by the worker
            await anext(router.generate(GenerationInput(prompt_token_ids=[0, 1])))
        with pytest.raises(InvalidRequestError):  # rejected by the router: prompt too long
            await anext(router.generate(GenerationInput(prompt_token_ids=[1] * 64)))
        running = router.generate(GenerationInput(request_id="a", prompt="x"))
        task = asyncio.create_task(_next(running))
        await wait_until_async(lambda: "a" in backend.sinks, 4.0)
        with pytest.raises(DuplicateRequestError):
            await anext(router.generate(GenerationInput(request_id="a", prompt="x")))
        queued = asyncio.create_task(_next(router.generate(GenerationInput(prompt="y"))))
        await wait_until_async(lambda: router.num_queued == 1, 4.0)
        with pytest.raises(QueueFullError):
            await anext(router.generate(GenerationInput(prompt="z")))
        task.cancel()
        queued.cancel()
        await asyncio.gather(task, queued, return_exceptions=True)
        await running.aclose()
        await wait_until_async(lambda: "a" in backend.aborted, 4.0)
        await router.close()

    asyncio.run(run())


def test_abort_while_starting_and_when_the_router_leaves(worker: Any) -> None:
    backend, server = worker

    async def run() -> None:
        router = _router(server.address)
        backend.hold_submit.clear()
        early = router.generate(GenerationInput(request_id="early", prompt="x"))
        task = asyncio.create_task(_next(early))
        await asyncio.sleep(0.2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await early.aclose()
        backend.hold_submit.set()  # submit completes after the abort arrived
        await wait_until_async(lambda: "early" in backend.aborted, 4.0)

        left = router.generate(GenerationInput(request_id="left", prompt="x"))
        task = asyncio.create_task(_next(left))
        await wait_until_async(lambda: "left" in backend.sinks, 4.0)
        await router.close()  # the Connect stream ends: the worker aborts what it carried
        await wait_until_async(lambda: "left" in backend.aborted, 4.0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())


def test_unavailable_without_ready_workers_and_worker_down(worker: Any) -> None:
    backend, server = worker

    async def run() -> None:
        router = _router(server.address)
        stream = router.generate(GenerationInput(request_id="doomed", prompt="x"))
        task = asyncio.create_task(_next(stream))
        await wait_until_async(lambda: "doomed" in backend.sinks, 4.0)
        router.registry.set_health("decode-0", "unhealthy")
        with pytest.raises(WorkerFailedError):
            await task
        with pytest.raises(UnavailableError):
            await anext(router.generate(GenerationInput(prompt="x")))
        await router.close()

    asyncio.run(run())


def test_a_draining_router_refuses_new_requests_and_lets_running_ones_finish(worker: Any) -> None:
    backend, server = worker

    async def run() -> None:
        router = _router(server.address)
        stream = router.generate(GenerationInput(request_id="r", prompt="x"))
        first = asyncio.create_task(_next(stream))
        await wait_until_async(lambda: "r" in backend.sinks, 4.0)
        drain = asyncio.create_task(router.drain(30))
        await asyncio.sleep(0.05)
        with pytest.raises(UnavailableError):
            await anext(router.generate(GenerationInput(prompt="y")))
        backend.emit("r", ord("a"), "stop")
        assert (await first).finish_reason == "stop"
        await stream.aclose()
        await asyncio.wait_for(drain, 10)  # returns once the running request finished
        await router.close()

    asyncio.run(run())


def test_a_draining_router_serves_what_it_queued_before_the_drain(worker: Any) -> None:
    """Accepted means served (or an error): a request queued when the drain began gets the
    room a finishing request frees within the grace period; one still queued when the grace
    period ends gets UNAVAILABLE."""
    backend, server = worker

    async def run() -> None:
        router = _router(server.address, capacity=1, max_queue=2)
        running = router.generate(GenerationInput(request_id="running", prompt="x"))
        first = asyncio.create_task(_next(running))
        await wait_until_async(lambda: "running" in backend.sinks, 4.0)
        queued = router.generate(GenerationInput(request_id="queued", prompt="x"))
        waiting = asyncio.create_task(_next(queued))
        await wait_until_async(lambda: router.num_queued == 1, 4.0)
        drain = asyncio.create_task(router.drain(30))
        await asyncio.sleep(0.05)
        with pytest.raises(UnavailableError):
            await anext(router.generate(GenerationInput(prompt="new")))
        backend.emit("running", ord("a"), "stop")
        assert (await first).finish_reason == "stop"
        await running.aclose()
        await wait_until_async(lambda: "queued" in backend.sinks, 4.0)  # it got the freed room
        backend.emit("queued", ord("b"), "stop")
        assert (await waiting).finish_reason == "stop"
        await queued.aclose()
        await asyncio.wait_for(drain, 10)

        # Grace over with a request still queued: it ends with UNAVAILABLE.
        router = _router(server.address, capacity=1, max_queue=2)
        held = router.generate(GenerationInput(request_id="held", prompt="x"))
        holding = asyncio.create_task(_next(held))
        await wait_until_async(lambda: "held" in backend.sinks, 4.0)
        late = router.generate(GenerationInput(request_id="late", prompt="x"))
        late_task = asyncio.create_task(_next(late))
        await wait_until_async(lambda: router.num_queued == 1, 4.0)
        await router.drain(0.2)
        with pytest.raises(UnavailableError):
            await late_task
        holding.cancel()
        await asyncio.gather(holding, return_exceptions=True)
        await router.close()

    asyncio.run(run())


class PrefillFailingBackend(FakeBackend):
    """A decoder whose KV transfer from prefill endpoint b"dead" fails before any token (as the
    decode messenger reports a prefill killed or stalled past the transfer deadline)."""

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


def _disaggregated_router(
    address: str,
    prefill: dict[str, bytes],
    retries: int,
    metrics: Metrics | None = None,
    local_fallback: bool = False,
) -> Router:
    registry = Registry()
    registry.add(_record("decode-0", address))
    for i, (worker_id, endpoint) in enumerate(prefill.items()):
        registry.add(
            WorkerRecord(worker_id, "prefill", i, health="healthy", prefill_endpoint=endpoint)
        )
    settings = RouterSettings(
        serving_role="decode",
        is_disaggregated=True,
        vocab_size=512,
        max_model_len=64,
        pool_tokens=1024,
        capacity_per_worker=4,
        max_queue=1,
        default_max_tokens=8,
        prefill_retries=retries,
        local_prefill_fallback=local_fallback,
        seed=0,
    )
    return Router(settings, registry, ByteTokenizer(), metrics)


@pytest.mark.parametrize("order", [("dead", "live"), ("live", "dead")])
def test_a_failed_prefill_is_retried_on_another_before_any_token(order: tuple[str, str]) -> None:
    backend = PrefillFailingBackend()
    server = WorkerServer(WorkerServicer("decode-0", backend))
    endpoints = {f"prefill-{i}": name.encode() for i, name in enumerate(order)}
    registry = CollectorRegistry()

    async def run() -> None:
        metrics = Metrics(registry, role="router", model="m")
        router = _disaggregated_router(server.address, endpoints, retries=1, metrics=metrics)
        served = 0
        for n in range(6):  # the random source is the dead one in some of these
            request_id = f"r{n}"
            task = asyncio.create_task(_next(router.generate(GenerationInput(request_id, "x"))))
            await wait_until_async(lambda rid=request_id: rid in backend.sinks, 4.0)  # type: ignore[misc]
            backend.emit(request_id, ord("k"), "length")
            assert (await task).finish_reason == "length"
            served += 1
        assert served == 6
        assert b"dead" in backend.endpoints  # the retry path ran
        # Every request ended on the live source; each dead attempt was followed by a live one.
        assert backend.endpoints.count(b"live") == 6
        labels = {"role": "router", "model": "m"}
        retries = "pdserve_router_retries_total"
        prefill = registry.get_sample_value(retries, {**labels, "kind": "prefill"})
        assert prefill == backend.endpoints.count(b"dead")
        assert registry.get_sample_value(retries, {**labels, "kind": "worker"}) == 0
        await router.close()

    try:
        asyncio.run(run())
    finally:
        server.stop(0.1)


def test_the_router_sends_prefill_to_the_source_with_the_fewest_prompt_tokens_in_flight() -> None:
    backend = PrefillFailingBackend()
    server = WorkerServer(WorkerServicer("decode-0", backend))

    registry = CollectorRegistry()

    def gauge(worker_id: str) -> float | None:  # what Prometheus scrapes for the worker
        labels = {"role": "router", "model": "m", "worker": worker_id}
        return registry.get_sample_value("pdserve_router_prefill_tokens_in_flight", labels)

    async def run() -> None:
        metrics = Metrics(registry, role="router", model="m")
        endpoints = {"prefill-0": b"p0", "prefill-1": b"p1"}
        router = _disaggregated_router(server.address, endpoints, 0, metrics)
        endpoint_of = {b"p0": "prefill-0", b"p1": "prefill-1"}
        started: list[asyncio.Task[StreamEvent]] = []
        streams: list[AsyncGenerator[StreamEvent, None]] = []

        async def start(request_id: str, prompt: str) -> str:
            stream = router.generate(GenerationInput(request_id, prompt))
            streams.append(stream)
            started.append(asyncio.create_task(_next(stream)))
            await wait_until_async(lambda: request_id in backend.sinks, 4.0)
            return endpoint_of[backend.endpoints[-1]]

        long_source = await start("long", "x" * 40)
        other = "prefill-1" if long_source == "prefill-0" else "prefill-0"
        assert [await start(f"short{i}", "yy") for i in range(3)] == [other] * 3
        assert router.prefill_load.tokens(long_source) > router.prefill_load.tokens(other) > 0
        assert gauge(long_source) == router.prefill_load.tokens(long_source)
        assert gauge(other) == router.prefill_load.tokens(other)
        # The long prompt's first token: its prefill is over, its source is free again.
        backend.emit("long", ord("a"))
        await asyncio.wait_for(started[0], 10)
        assert router.prefill_load.tokens(long_source) == gauge(long_source) == 0
        backend.emit("short0", ord("b"), "length")  # a slot for one more (capacity 4)
        assert (await started[1]).finish_reason == "length"
        await streams[1].aclose()  # the stream ends: its worker slot is released
        assert await start("next", "zz") == long_source
        for request_id in ("short1", "short2", "next"):
            backend.emit(request_id, ord("b"), "length")
        for task, stream in zip(started[2:], streams[2:], strict=True):
            assert (await task).finish_reason == "length"
            await stream.aclose()
        assert router.prefill_load.tokens("prefill-0") == router.prefill_load.tokens("prefill-1")
        assert router.prefill_load.tokens("prefill-0") == 0
        # A request that ends before its first token (the client went away) releases too.
        gone = await start("gone", "x" * 30)
        assert router.prefill_load.tokens(gone) > 0
        started[-1].cancel()
        with pytest.raises(asyncio.CancelledError):
            await started[-1]
        assert router.prefill_load.tokens(gone) == gauge(gone) == 0
        assert gauge("prefill-0") == gauge("prefill-1") == 0
        await streams[0].aclose()
        await router.close()

    try:
        asyncio.run(run())
    finally:
        server.stop(0.1)


def test_without_retries_or_another_prefill_the_request_fails() -> None:
    backend = PrefillFailingBackend()
    server = WorkerServer(WorkerServicer("decode-0", backend))

    async def run() -> None:
        for endpoints, retries in (
            ({"prefill-0": b"dead", "prefill-1": b"dead"}, 0),
            ({"prefill-0": b"dead"}, 3),
        ):
            router = _disaggregated_router(server.address, endpoints, retries)
            before = len(backend.endpoints)
            with pytest.raises(WorkerFailedError, match="deadline"):
                await anext(router.generate(GenerationInput("doomed", "x")))
            assert len(backend.endpoints) - before == 1  # no second attempt
            assert router.num_outstanding == 0
            await router.close()

    try:
        asyncio.run(run())
    finally:
        server.stop(0.1)


def test_with_no_other_prefill_source_the_decoder_prefills_the_request_itself() -> None:
    """``local_prefill_fallback``: a request whose only prefill worker failed it, and one sent
    while no prefill worker is ready, go to the decoder with an empty prefill endpoint (it
    prefills them in its own steps); without the fallback both fail."""
    backend = PrefillFailingBackend()
    server = WorkerServer(WorkerServicer("decode-0", backend))
    registry = CollectorRegistry()

    async def serve(router: Router, request_id: str) -> None:
        async def events() -> list[StreamEvent]:
            return [e async for e in router.generate(GenerationInput(request_id, "x"))]

        task = asyncio.create_task(events())
        await wait_until_async(lambda: request_id in backend.sinks, 4.0)
        backend.emit(request_id, ord("k"), "length")
        assert [e.finish_reason for e in await task] == ["length"]

    async def run() -> None:
        metrics = Metrics(registry, role="router", model="m")
        router = _disaggregated_router(
            server.address, {"prefill-0": b"dead"}, 1, metrics, local_fallback=True
        )
        await serve(router, "failed-over")
        assert backend.endpoints == [b"dead", b""]
        labels = {"role": "router", "model": "m", "kind": "prefill"}
        assert registry.get_sample_value("pdserve_router_retries_total", labels) == 1
        router.registry.set_health("prefill-0", "unhealthy")
        await serve(router, "no-prefill")
        assert backend.endpoints[2:] == [b""]
        assert router.num_outstanding == 0
        await router.close()

        router = _disaggregated_router(server.address, {"prefill-0": b"dead"}, 1)
        router.registry.set_health("prefill-0", "unhealthy")
        with pytest.raises(UnavailableError, match="no ready prefill worker"):
            await anext(router.generate(GenerationInput("refused", "x")))
        assert backend.endpoints[3:] == []
        await router.close()

    try:
        asyncio.run(run())
    finally:
        server.stop(0.1)
