"""A small client of ``pdserve.v1.Generation`` (``pdserve generate``, the demo, the tests)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from orchestrator.api.security import channel_credentials, token_interceptors
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc


@dataclass
class Completion:
    """A finished stream, reassembled."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    usage: pb.Usage | None = None
    timings: pb.Timings | None = None
    num_messages: int = 0


async def stream(
    stub: pb_grpc.GenerationStub, request: pb.GenerateRequest, timeout: float | None = None
) -> AsyncIterator[pb.GenerateResponse]:
    async for response in stub.Generate(request, timeout=timeout):
        yield response


async def complete(
    stub: pb_grpc.GenerationStub, request: pb.GenerateRequest, timeout: float | None = None
) -> Completion:
    result = Completion()
    async for response in stub.Generate(request, timeout=timeout):
        result.request_id = response.request_id
        result.text += response.text
        result.token_ids.extend(response.token_ids)
        result.num_messages += 1
        if response.finish_reason:
            result.finish_reason = response.finish_reason
            result.usage = response.usage
            result.timings = response.timings
    return result


def channel(
    address: str,
    *,
    tls_ca: Path | None = None,
    client_cert: Path | None = None,
    client_key: Path | None = None,
    token: str | None = None,
    tls: bool = False,
) -> grpc.aio.Channel:
    """An asyncio channel to the router at ``address``.

    TLS is on when ``tls`` or any of ``tls_ca`` (the CA that signed the router's certificate;
    None: the system's roots), ``client_cert`` / ``client_key`` (mTLS, both or neither) is
    given; otherwise plaintext. ``token`` is sent as ``authorization: Bearer`` on every call.
    Unreadable files raise `orchestrator.api.security.TLSFileError` before anything connects.
    """
    interceptors = token_interceptors(token) if token else None
    if tls or tls_ca is not None or client_cert is not None or client_key is not None:
        credentials = channel_credentials(tls_ca, client_cert, client_key)
        return grpc.aio.secure_channel(address, credentials, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, interceptors=interceptors)
