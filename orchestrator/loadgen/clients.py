"""Streaming clients of the router: gRPC (``pdserve.v1.Generation``, one shared grpc.aio
channel) and OpenAI HTTP (``/v1/completions`` with ``stream: true``, SSE over one aiohttp
session).

Both fill a `RequestResult` as messages arrive: the arrival time of each message and how many
tokens it carries (gRPC: ``token_ids`` with ``return_token_ids``; HTTP: ``logprobs.tokens``
with ``logprobs: 0``, the only per-chunk token count the OpenAI shape has). A failure is
recorded on the result (status name or HTTP status), never raised: every request is counted.
So is a stream that ended before its request ran its course (`check_finish`): aborted, or cut
at ``length`` short of ``max_tokens`` (max_model_len, or a request that outgrew the KV pool),
whose tokens would flatter TPOT and goodput.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from orchestrator.api.client import channel as router_channel
from orchestrator.loadgen.records import RequestResult
from orchestrator.loadgen.requests import TimedRequest
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc

Clock = Callable[[], float]


@dataclass(frozen=True)
class ModelInfo:
    name: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int


class Client(Protocol):
    name: str

    async def send(self, request: TimedRequest, result: RequestResult, now: Clock) -> None: ...

    async def close(self) -> None: ...


async def model_info(address: str, timeout: float = 30.0, token: str | None = None) -> ModelInfo:
    async with router_channel(address, token=token) as channel:
        info = await pb_grpc.GenerationStub(channel).GetModelInfo(
            pb.GetModelInfoRequest(), timeout=timeout
        )
    return ModelInfo(
        info.model_name, info.vocab_size, tuple(info.eos_token_ids), info.max_model_len
    )


def check_finish(request: TimedRequest, result: RequestResult) -> None:
    """Record a finished stream that did not run its course as an error. ``stop`` (EOS or a
    stop string) is a course run at any length; ``length`` only at ``max_tokens``."""
    # The server's own count where it sent one: a server may send chunks without token counts.
    tokens = max(result.output_tokens, result.usage_completion_tokens or 0)
    reason = result.finish_reason
    if reason == "stop" or (reason == "length" and tokens >= request.max_tokens):
        return
    result.error = (
        f"ended early: {reason or 'no finish reason'} after {tokens} of {request.max_tokens} tokens"
    )
    result.finish_s = None  # set for completed requests only


class GrpcClient:
    name = "grpc"

    def __init__(self, address: str, timeout: float, token: str | None = None) -> None:
        # One channel (one HTTP/2 connection) for every stream: what one client process opens.
        self._channel = router_channel(address, token=token)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._timeout = timeout

    async def send(self, request: TimedRequest, result: RequestResult, now: Clock) -> None:
        message = pb.GenerateRequest(
            request_id=f"bench-{request.index}",
            prompt_token_ids=request.prompt_token_ids,
            sampling=pb.SamplingParams(
                temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True
            ),
            return_token_ids=True,
        )
        try:
            result.sent_s = now()
            async for response in self._stub.Generate(message, timeout=self._timeout):
                arrived = now()
                result.chunks.append((arrived, len(response.token_ids)))
                result.token_ids.extend(response.token_ids)
                if response.finish_reason:
                    result.finish_reason = response.finish_reason
                    result.usage_completion_tokens = response.usage.completion_tokens
                    result.finish_s = arrived
            if result.finish_s is None:
                result.error = "incomplete"  # the stream ended without its last message
            else:
                check_finish(request, result)
        except grpc.aio.AioRpcError as error:
            result.error = error.code().name
            result.finish_s = None

    async def close(self) -> None:
        await self._channel.close()


class HttpClient:
    name = "http"

    def __init__(self, url: str, timeout: float, api_key: str | None = None) -> None:
        import aiohttp

        base = url.rstrip("/")
        self._url = (base if base.endswith("/v1") else base + "/v1") + "/completions"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),  # open loop: no client-side queueing
            timeout=aiohttp.ClientTimeout(total=timeout),
            headers=headers,
        )

    async def send(self, request: TimedRequest, result: RequestResult, now: Clock) -> None:
        import aiohttp

        body = {
            "prompt": list(request.prompt_token_ids),
            "max_tokens": request.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "logprobs": 0,  # per-chunk tokens: the token count of each message
            "stream_options": {"include_usage": True},
        }
        try:
            result.sent_s = now()
            async with self._session.post(self._url, json=body) as response:
                if response.status != 200:
                    result.error = f"HTTP {response.status}"
                    return
                async for line in response.content:
                    arrived = now()
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        result.finish_s = arrived
                        break
                    self._on_event(json.loads(data), arrived, result)
                    if result.error:
                        return
            if result.finish_s is None:
                result.error = "incomplete"
            else:
                check_finish(request, result)
        except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as error:
            result.error = type(error).__name__
            result.finish_s = None

    @staticmethod
    def _on_event(event: dict[str, Any], arrived: float, result: RequestResult) -> None:
        if "error" in event:
            error = event["error"]  # OpenAI's shape is an object; a server may send a string
            code = error.get("code") if isinstance(error, dict) else error
            result.error = f"stream: {code or 'error'}"
            return
        if event.get("usage"):
            result.usage_completion_tokens = event["usage"]["completion_tokens"]
        for choice in event.get("choices") or ():
            logprobs = choice.get("logprobs") or {}
            result.chunks.append((arrived, len(logprobs.get("tokens") or ())))
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]

    async def close(self) -> None:
        await self._session.close()
