"""Regressions of the request path, against real parts: the router over gRPC to a worker running
the tiny preset's engine, the aiohttp front, and a prefill + decode pair over libfabric ``tcp``.

- a client's request id reused right after a cancel (the old abort still on its way)
- an HTTP client that leaves: its request is aborted, not generated or admitted for nobody
- numbers no float or ``json`` can hold: 400, not 500
- a request sent on a worker stream that already ended: UNAVAILABLE, not INTERNAL
- disaggregated serving returns the logprobs it was asked for
- chat logprobs ``bytes`` are each token's own bytes, also for part of a character
- a stop token id's text is not output (as in the engine and vLLM), its id still is
- a second router on a bound address fails to bind (no SO_REUSEPORT sharing)
- an IPv6 host is advertised in brackets
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from prometheus_client import CollectorRegistry

from orchestrator.errors import WorkerFailedError
from orchestrator.http_api import HttpSettings, OpenAIHttpApi
from orchestrator.openai_protocol import completion_response, parse_request
from orchestrator.registry import Registry, WorkerRecord
from orchestrator.router import GenerationInput, Router, RouterSettings, StreamEvent, Timings
from orchestrator.servicer import status_of
from orchestrator.worker_backend import MixedBackend
from orchestrator.worker_service import WorkerServer, WorkerServicer
from tests.orchestrator.cluster_helpers import wait_until_async
from tests.orchestrator.test_router_units import FakeBackend, _next, _router
from workers.engine.config import EngineConfig
from workers.engine.tokenizer import ByteTokenizer, load_tokenizer
from workers.metrics import Metrics

MAX_MODEL_LEN = 512
NUM_PAGES = 128
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def mixed(tiny_model_dir: Path) -> Iterator[tuple[MixedBackend, WorkerServer]]:
    backend = MixedBackend(
        tiny_model_dir, EngineConfig(num_pages=NUM_PAGES, max_model_len=MAX_MODEL_LEN)
    )
    server = WorkerServer(WorkerServicer("mixed-0", backend))
    try:
        yield backend, server
    finally:
        server.stop(0.1)
        backend.close()


def mixed_router(
    model_dir: Path, address: str, *, capacity: int = 8, metrics: Metrics | None = None
) -> Router:
    tokenizer = load_tokenizer(model_dir)
    registry = Registry()
    registry.add(WorkerRecord("mixed-0", "mixed", 0, health="healthy", address=address))
    settings = RouterSettings(
        serving_role="mixed",
        is_disaggregated=False,
        vocab_size=tokenizer.vocab_size,
        max_model_len=MAX_MODEL_LEN,
        pool_tokens=NUM_PAGES * 16,
        capacity_per_worker=capacity,
        max_queue=8,
        default_max_tokens=16,
        eos_token_ids=frozenset(tokenizer.eos_token_ids),
    )
    return Router(settings, registry, tokenizer, metrics)


async def engine_idle(backend: MixedBackend) -> None:
    loop = asyncio.get_running_loop()
    for _ in range(6000):
        load = await loop.run_in_executor(None, backend.load)
        if load.num_running_requests == load.num_waiting_requests == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the engine never went idle")


# --- 1: a reused request id -------------------------------------------------------------------


def test_a_request_id_reused_right_after_a_cancel_serves_the_new_request(
    mixed: tuple[MixedBackend, WorkerServer], tiny_model_dir: Path
) -> None:
    """The old request's abort is sent in the background when its stream closes; the new one
    with the same client id goes out at once. Workers know each by its own worker request id,
    so the abort ends the old one only, and the new one streams to its end under the client's
    id."""
    backend, server = mixed

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


# --- 2: an HTTP client that leaves ------------------------------------------------------------


async def with_api(
    model_dir: Path,
    address: str,
    body: Callable[[Router, str], Awaitable[None]],
    *,
    capacity: int = 8,
    metrics: Metrics | None = None,
) -> None:
    router = mixed_router(model_dir, address, capacity=capacity, metrics=metrics)
    api = OpenAIHttpApi(router, HttpSettings(model_name="tiny"))
    http_address = await api.start("127.0.0.1", 0)
    try:
        await body(router, http_address)
    finally:
        await api.stop()
        await router.close()


async def open_request(address: str, body: dict[str, Any]) -> asyncio.StreamWriter:
    """A raw HTTP/1.1 request whose connection the test closes (the client leaving)."""
    host, port = address.split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps(body).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    writer.write(head.encode() + data)
    await writer.drain()
    return writer


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    await writer.wait_closed()


def request_ends(registry: CollectorRegistry) -> dict[str, float]:
    ends = {}
    for reason in ("abort", "length", "stop"):
        labels = {"role": "router", "model": "tiny", "finished_reason": reason}
        ends[reason] = registry.get_sample_value("pdserve_request_success_total", labels) or 0.0
    return ends


def test_a_client_that_leaves_a_non_streamed_request_aborts_it(
    mixed: tuple[MixedBackend, WorkerServer],
    tiny_model_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend, server = mixed
    registry = CollectorRegistry()

    async def body(router: Router, address: str) -> None:
        request = {"prompt": "hello", "max_tokens": 480, **GREEDY}
        writer = await open_request(address, request)
        await wait_until_async(lambda: router.num_outstanding == 1)
        await close(writer)
        await wait_until_async(lambda: router.num_outstanding == 0)
        await engine_idle(backend)

    metrics = Metrics(registry, role="router", model="tiny")
    with caplog.at_level(logging.ERROR):
        asyncio.run(with_api(tiny_model_dir, server.address, body, metrics=metrics))
    # Aborted when the client left, not generated to max_tokens for nobody.
    assert request_ends(registry) == {"abort": 1.0, "length": 0.0, "stop": 0.0}
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_client_that_leaves_a_queued_stream_frees_its_place(
    mixed: tuple[MixedBackend, WorkerServer],
    tiny_model_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One slot, held by the test; a streamed request waits in the queue and its client
    leaves: it leaves the queue at once, rather than when the slot frees (then to be admitted,
    prefilled and answered to nobody, with an error logged)."""
    backend, server = mixed

    async def body(router: Router, address: str) -> None:
        holder = router.generate(GenerationInput("holder", "hi", sampling=GREEDY, max_tokens=8))
        await anext(holder)  # admitted; the slot stays taken until this stream closes
        request = {"prompt": "x", "max_tokens": 480, "stream": True, **GREEDY}
        writer = await open_request(address, request)
        await wait_until_async(lambda: router.num_queued == 1)
        await close(writer)
        await wait_until_async(lambda: router.num_queued == 0)
        assert router.num_outstanding == 1  # the holder only: the other one was not admitted
        await holder.aclose()
        await engine_idle(backend)

    with caplog.at_level(logging.ERROR):
        asyncio.run(with_api(tiny_model_dir, server.address, body, capacity=1))
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# --- 3: numbers beyond range ------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "hi", "max_tokens": 2, "temperature": ' + b"9" * 400 + b"}",
        b'{"prompt": "hi", "top_p": -' + b"9" * 400 + b"}",
        b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",  # beyond int("...") too
    ],
)
def test_numbers_no_float_or_parser_holds_are_400(
    mixed: tuple[MixedBackend, WorkerServer], tiny_model_dir: Path, body: bytes
) -> None:
    _, server = mixed
    answers = []

    async def post(router: Router, address: str) -> None:
        headers = {"Content-Type": "application/json"}
        async with aiohttp.ClientSession() as session:
            url = f"http://{address}/v1/completions"
            async with session.post(url, data=body, headers=headers) as response:
                answers.append((response.status, await response.json()))
        assert router.num_outstanding == 0

    asyncio.run(with_api(tiny_model_dir, server.address, post))
    ((status, error),) = answers
    assert status == 400
    assert error["error"]["type"] == "invalid_request_error"


# --- 4: a worker stream that already ended ----------------------------------------------------


def test_a_request_sent_on_a_stream_that_already_ended_is_unavailable() -> None:
    """Between the end of a worker's Connect stream and the moment the link's reader task sees
    it, a request still goes out on that stream. The worker dying makes that window, but not
    on demand: here the stream is ended by cancelling it (a real call, really finished) in the
    same event-loop turn as the next request, so that request always lands in the window."""
    backend = FakeBackend()
    server = WorkerServer(WorkerServicer("decode-0", backend))

    async def run() -> None:
        router = _router(server.address)
        first = router.generate(GenerationInput("first", "x"))
        task = asyncio.create_task(_next(first))
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
        assert router._is_suspect(router.registry.workers["decode-0"])  # not chosen again
        await router.close()

    try:
        asyncio.run(run())
    finally:
        server.stop(0.1)


# --- 5: logprobs in disaggregated serving -----------------------------------------------------


async def _events(router: Router, request: GenerationInput) -> list[StreamEvent]:
    stream: AsyncIterator[StreamEvent] = router.generate(request)
    return [event async for event in stream]


def test_disaggregated_serving_returns_the_logprobs_the_mixed_path_does(
    mixed: tuple[MixedBackend, WorkerServer], tiny_model_dir: Path
) -> None:
    from orchestrator.kv_backends import DecodeBackend
    from tests.kv.harness import RemotePrefill

    _, mixed_server = mixed
    prefill = RemotePrefill(tiny_model_dir, "tcp;ofi_rxm", engine={"num_pages": 64})
    decode: DecodeBackend | None = None
    server: WorkerServer | None = None
    request = GenerationInput(
        "lp",
        "hello there",
        sampling={"temperature": 0.0},
        max_tokens=6,
        return_token_ids=True,
        return_logprobs=True,
    )

    async def run() -> tuple[list[StreamEvent], list[StreamEvent]]:
        assert server is not None
        tokenizer = load_tokenizer(tiny_model_dir)
        registry = Registry()
        registry.add(
            WorkerRecord("decode-0", "decode", 0, health="healthy", address=server.address)
        )
        registry.add(
            WorkerRecord(
                "prefill-0",
                "prefill",
                0,
                health="healthy",
                prefill_endpoint=prefill.endpoint.to_bytes(),
            )
        )
        settings = RouterSettings("decode", True, tokenizer.vocab_size, 512, 64 * 16, 4, 4, 8)
        router = Router(settings, registry, tokenizer)
        baseline = mixed_router(tiny_model_dir, mixed_server.address)
        try:
            return await _events(router, request), await _events(baseline, request)
        finally:
            await router.close()
            await baseline.close()

    try:
        decode = DecodeBackend(
            tiny_model_dir, EngineConfig(role="decode", num_pages=64), "tcp;ofi_rxm", None, {}
        )
        server = WorkerServer(WorkerServicer("decode-0", decode))
        disaggregated, colocated = asyncio.run(run())
        # The KV came over the fabric; its record is found by the client's id.
        assert (decode.transfer_stats("lp") or {}).get("state") is not None
    finally:
        if server is not None:
            server.stop(0.1)
        if decode is not None:
            decode.close()
        prefill.close()
    ids = [t for event in disaggregated for t in event.token_ids]
    logprobs = [v for event in disaggregated for v in event.logprobs]
    assert len(ids) == len(logprobs) == 6
    assert all(math.isfinite(v) and v <= 0.0 for v in logprobs)
    assert ids == [t for event in colocated for t in event.token_ids]
    expected = [v for event in colocated for v in event.logprobs]
    assert logprobs == pytest.approx(expected, abs=1e-3)


# --- 6: chat logprobs bytes -------------------------------------------------------------------


@pytest.mark.parametrize("text", ["é", "日本 😀", "a b"])
def test_chat_logprob_bytes_are_each_tokens_own_bytes(tiny_model_dir: Path, text: str) -> None:
    """The preset's byte-level BPE tokens are single bytes: most of a character's tokens hold
    part of it, which decodes to U+FFFD alone."""
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = tokenizer.encode(text, add_special_tokens=False)
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    parsed = parse_request("chat", body, "tiny", tokenizer)
    event = StreamEvent(
        parsed.generation.request_id,
        text,
        ids,
        [-0.5] * len(ids),
        "stop",
        3,
        len(ids),
        Timings(0.0, 0.0, 0.0, 0.0),
    )
    content = completion_response(parsed, [event], tokenizer)["choices"][0]["logprobs"]["content"]
    assert b"".join(bytes(entry["bytes"]) for entry in content) == text.encode()
    # ``token`` stays the token's text, as vLLM gives it.
    assert [entry["token"] for entry in content] == [tokenizer.decode([t]) for t in ids]


def test_token_bytes_of_both_tokenizers(tiny_model_dir: Path) -> None:
    text = "é 日本 😀 a"
    for tokenizer in (load_tokenizer(tiny_model_dir), ByteTokenizer()):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(tokenizer.token_bytes(ids)) == text.encode()
        assert tokenizer.token_bytes([256]) == [b"<s>"]  # a special token: its text


# --- 7: a stop token id adds no text -----------------------------------------------------------


def test_a_stop_token_ids_text_is_not_output(
    mixed: tuple[MixedBackend, WorkerServer], tiny_model_dir: Path
) -> None:
    """An ordinary token named in ``stop_token_ids`` ends the request, is streamed as an id,
    and adds no text: the text equals that of the same request cut before it by max_tokens."""

    async def run() -> None:
        router = mixed_router(tiny_model_dir, mixed[1].address)

        async def generate(max_tokens: int, **sampling: Any) -> tuple[str, list[int], str]:
            request = GenerationInput(
                prompt="hello world",
                sampling={**GREEDY, **sampling},
                max_tokens=max_tokens,
                return_token_ids=True,
            )
            events = [event async for event in router.generate(request)]
            ids = [token for event in events for token in event.token_ids]
            return "".join(event.text for event in events), ids, events[-1].finish_reason

        _, ids, _ = await generate(12)
        # The first output token not seen before it: the request stops there, not earlier.
        cut = next(i for i, token in enumerate(ids) if i >= 3 and token not in ids[:i])
        expected_text, _, _ = await generate(cut)
        text, stopped_ids, reason = await generate(12, stop_token_ids=[ids[cut]])
        assert (stopped_ids, reason) == (ids[: cut + 1], "stop")
        assert text == expected_text
        await router.close()

    asyncio.run(run())


# --- 8, 9: the router's address -------------------------------------------------------------


def test_a_second_router_on_the_same_address_fails_to_bind() -> None:
    """gRPC's default SO_REUSEPORT would let both bind and split the clients between them."""
    from orchestrator.app import router_grpc_server

    async def run() -> None:
        first = router_grpc_server([], 1 << 20)
        port = first.add_insecure_port("127.0.0.1:0")
        await first.start()
        try:
            second = router_grpc_server([], 1 << 20)
            with pytest.raises(RuntimeError):
                second.add_insecure_port(f"127.0.0.1:{port}")
        finally:
            await first.stop(None)

    asyncio.run(run())


def test_an_ipv6_host_is_advertised_in_brackets() -> None:
    from orchestrator.config_sections import RouterConfig, join_host_port

    router = RouterConfig(address="[::1]:50051")
    assert join_host_port(router.host, router.port) == "[::1]:50051"
    assert join_host_port("127.0.0.1", 8000) == "127.0.0.1:8000"
