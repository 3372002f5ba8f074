"""The aiohttp front over a real mixed worker (tiny preset) without Ray: a client that leaves
aborts its request (not generated, nor admitted, for nobody); numbers no float or parser holds
are a 400, not a 500."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from orchestrator.api.http import HttpSettings, OpenAIHttpApi
from orchestrator.router.core import Router
from orchestrator.router.types import GenerationInput
from tests.orchestrator.harness import GREEDY, engine_idle, mixed_router
from tests.waiting import wait_until_async
from workers.metrics import Metrics
from workers.service.backend import MixedBackend
from workers.service.server import WorkerServer


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
    mixed_worker: tuple[MixedBackend, WorkerServer],
    tiny_model_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend, server = mixed_worker
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
    mixed_worker: tuple[MixedBackend, WorkerServer],
    tiny_model_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One slot, held by the test; a streamed request waits in the queue and its client
    leaves: it leaves the queue at once, rather than when the slot frees (then to be admitted,
    prefilled and answered to nobody, with an error logged)."""
    backend, server = mixed_worker

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


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "hi", "max_tokens": 2, "temperature": ' + b"9" * 400 + b"}",
        b'{"prompt": "hi", "top_p": -' + b"9" * 400 + b"}",
        b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",  # beyond int("...") too
    ],
)
def test_numbers_no_float_or_parser_holds_are_400(
    mixed_worker: tuple[MixedBackend, WorkerServer], tiny_model_dir: Path, body: bytes
) -> None:
    _, server = mixed_worker
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
