"""The load generator's streaming clients (gRPC and OpenAI HTTP) against small real servers
(grpc.aio, aiohttp) that stream what a router sends, or what a broken one might: a stream that
ends before its request ran its course is an error, a malformed stream fails its own request
only, a run reports its progress (a bar on a terminal, lines in a log), and `bench run` refuses
a warm-up that leaves nothing measured before sending anything."""

from __future__ import annotations

import asyncio
import io
import json
import re
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import pytest
from aiohttp import web

from orchestrator.cli.main import main
from orchestrator.loadgen.clients import GrpcClient, HttpClient
from orchestrator.loadgen.records import RequestResult
from orchestrator.loadgen.requests import TimedRequest
from orchestrator.loadgen.runner import run_open_loop
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
from tests.loadgen.test_requests_and_stats import _kept, _workload
from workers.log import set_progress

_T = TypeVar("_T")

# The servers' streams, chosen by the request's max_tokens: (tokens sent, finish reason).
GRPC_STREAMS = {4: (4, "length"), 5: (2, "stop"), 6: (3, "abort"), 7: (2, "length")}


class _Router(pb_grpc.GenerationServicer):  # type: ignore[misc]
    """The router's Generation service as far as the load generator uses it."""

    def __init__(self) -> None:
        self.num_generated = 0

    async def GetModelInfo(self, request: Any, context: Any) -> Any:
        return pb.GetModelInfoResponse(
            model_name="scripted", vocab_size=64, max_model_len=4096, eos_token_ids=[0]
        )

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.num_generated += 1
        max_tokens = request.sampling.max_tokens
        num_tokens, reason = GRPC_STREAMS.get(max_tokens, (max_tokens, "length"))
        for _ in range(num_tokens):
            yield pb.GenerateResponse(request_id=request.request_id, token_ids=[7])
        yield pb.GenerateResponse(
            request_id=request.request_id,
            finish_reason=reason,
            usage=pb.Usage(
                prompt_tokens=len(request.prompt_token_ids), completion_tokens=num_tokens
            ),
        )


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def _tokens(count: int, reason: str) -> list[bytes]:
    """``count`` one-token chunks, the last with ``reason``, then usage and [DONE]."""
    chunks = [
        _sse(
            {
                "choices": [
                    {
                        "index": 0,
                        "text": "a",
                        "logprobs": {"tokens": ["a"]},
                        "finish_reason": reason if i == count - 1 else None,
                    }
                ]
            }
        )
        for i in range(count)
    ]
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": count}}
    return [*chunks, _sse(usage), b"data: [DONE]\n\n"]


HTTP_STREAMS: dict[int, list[bytes]] = {
    4: _tokens(4, "length"),
    5: _tokens(2, "stop"),
    6: _tokens(3, "abort"),
    7: _tokens(2, "length"),
    8: [*_tokens(1, "")[:1], _sse({"error": "overloaded"})],  # an error event as a string
    9: [*_tokens(1, "")[:1], _sse({"choices": [], "usage": {"prompt_tokens": 3}})],
    10: [*_tokens(1, "")[:1], b'data: {"choices": "\xc3\x28"}\n\n'],  # not UTF-8
}


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    # Paced, so that the well-formed streams are still in flight when a malformed one breaks.
    for event in HTTP_STREAMS[body["max_tokens"]]:
        await asyncio.sleep(0.05)
        await response.write(event)
    await response.write_eof()
    return response


@dataclass
class _Servers:
    grpc_address: str
    http_url: str
    router: _Router


@pytest.fixture(scope="module")
def servers() -> Iterator[_Servers]:
    """A gRPC router and an OpenAI HTTP front on a loop of their own, as a router process is."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coroutine: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(30)

    router = _Router()

    async def start() -> tuple[grpc.aio.Server, int, web.AppRunner, int]:
        server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(router, server)
        grpc_port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        app = web.Application()
        app.router.add_post("/v1/completions", _completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        http_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return server, grpc_port, runner, http_port

    server, grpc_port, runner, http_port = call(start())
    try:
        yield _Servers(f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}", router)
    finally:
        call(server.stop(None))
        call(runner.cleanup())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def _requests(max_tokens: list[int]) -> list[TimedRequest]:
    return [
        TimedRequest(index=i, arrival_s=0.0, prompt_token_ids=(1, 2, 3), max_tokens=m, warmup=False)
        for i, m in enumerate(max_tokens)
    ]


def _errors(results: list[RequestResult]) -> dict[int, str | None]:
    return {r.max_tokens: r.error for r in results}


# --- streams that end before their course ---------------------------------------------------

EARLY = {
    4: None,  # length at max_tokens: its course
    5: None,  # stop (EOS) early: its course too
    6: "ended early: abort after 3 of 6 tokens",
    7: "ended early: length after 2 of 7 tokens",  # e.g. the KV pool ran out
}


def test_grpc_streams_that_end_early_are_errors(servers: _Servers) -> None:
    async def run() -> list[RequestResult]:
        client = GrpcClient(servers.grpc_address, timeout=30.0)
        try:
            outcome = await run_open_loop(client, _requests(list(EARLY)), progress=None)
        finally:
            await client.close()
        return outcome.results

    results = asyncio.run(run())
    assert _errors(results) == EARLY
    assert [r.ok for r in results] == [True, True, False, False]


def test_http_streams_that_end_early_are_errors(servers: _Servers) -> None:
    async def run() -> list[RequestResult]:
        client = HttpClient(servers.http_url, timeout=30.0)
        try:
            outcome = await run_open_loop(client, _requests(list(EARLY)), progress=None)
        finally:
            await client.close()
        return outcome.results

    results = asyncio.run(run())
    assert _errors(results) == EARLY
    assert [r.ok for r in results] == [True, True, False, False]


# --- a malformed stream fails its own request only ------------------------------------------


def test_a_malformed_stream_fails_its_request_not_the_run(servers: _Servers) -> None:
    async def run() -> list[RequestResult]:
        client = HttpClient(servers.http_url, timeout=30.0)
        try:
            outcome = await run_open_loop(client, _requests([4, 8, 9, 10, 4]), progress=None)
        finally:
            await client.close()
        return outcome.results

    results = asyncio.run(run())
    assert [r.ok for r in results] == [True, False, False, False, True]
    assert results[0].output_tokens == results[4].output_tokens == 4  # not cancelled
    assert results[1].error == "stream: overloaded"
    assert (results[2].error or "").startswith("KeyError: ")
    assert (results[3].error or "").startswith("UnicodeDecodeError: ")
    assert all(r.finish_s is None for r in results[1:4])


# --- progress: a bar on a terminal, lines in a log file, nothing when quiet -----------------


class _Terminal(io.StringIO):
    """A fake terminal: a text stream that says it is a TTY, so that a bar is drawn into it."""

    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_a_line_in_a_log(servers: _Servers) -> None:
    async def run(progress: io.StringIO) -> None:
        client = GrpcClient(servers.grpc_address, timeout=30.0)
        try:
            await run_open_loop(client, _requests(list(EARLY)), progress=progress)
        finally:
            await client.close()

    terminal, log_file, quiet = _Terminal(), io.StringIO(), _Terminal()
    asyncio.run(run(terminal))
    assert "bench grpc: 100%" in terminal.getvalue() and "4/4" in terminal.getvalue()
    assert "2 errors" in terminal.getvalue()  # the two streams that ended early
    asyncio.run(run(log_file))
    assert re.fullmatch(r"\[bench grpc\] 4/4 done, 2 errors, +[\d.]+ s\n", log_file.getvalue())
    set_progress(False)  # pdserve --quiet
    try:
        asyncio.run(run(quiet))
    finally:
        set_progress(True)
    assert quiet.getvalue() == ""


# --- bench run checks its warm-up before sending -------------------------------------------


def test_bench_run_refuses_a_warmup_that_leaves_nothing_measured(
    servers: _Servers, capsys: pytest.CaptureFixture[str]
) -> None:
    workload = _workload(rate=2.0)
    kept = _kept(workload, 3.0)
    argv = ["bench", "run", "--address", servers.grpc_address, "--rate", "2",
            "--num-requests", str(workload.num_requests), "--duration", "3",
            "--warmup", str(kept), "--seed", "7",  # the arrivals of _workload's seed
            "--prompt", "fixed:8", "--output", "fixed:4"]  # fmt: skip
    before = servers.router.num_generated
    assert main(argv) == 2
    assert "pdserve bench: warm-up must be in" in capsys.readouterr().err
    assert servers.router.num_generated == before  # nothing sent
