"""Bearer-token auth of a gRPC server: `TokenAuthInterceptor` rejects every call but health
checks unless it carries ``authorization: Bearer <token>`` metadata. The router's client front
uses it with ``router.auth.token`` (`orchestrator.api.security`), each worker's own service with
its cluster's secret, which only the router holds (`workers.service.server`)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

# Health checks carry no token (probes, load balancers), exactly as /health on HTTP.
OPEN_METHOD_PREFIXES: tuple[str, ...] = ("/grpc.health.v1.Health/",)
AUTH_METADATA_KEY = "authorization"  # gRPC metadata keys are lower case


def bearer_matches(header: str, token: str) -> bool:
    """Whether an ``Authorization`` value is ``Bearer <token>``, compared in constant time."""
    scheme, _, value = header.partition(" ")
    try:
        presented = value.strip().encode()
    except UnicodeEncodeError:  # bytes that are not UTF-8 (aiohttp keeps them as surrogates)
        return False
    return scheme.lower() == "bearer" and hmac.compare_digest(presented, token.encode())


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects every call but health checks unless it carries ``authorization: Bearer <token>``
    metadata: UNAUTHENTICATED, before the servicer sees the request."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("an empty token would let every client in")
        self._token = token

    async def intercept_service(
        self,
        continuation: Callable[[Any], Awaitable[Any]],
        handler_call_details: Any,
    ) -> Any:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        if self._authorized(handler_call_details.invocation_metadata or ()):
            return handler
        return _denying_handler(handler)

    def _authorized(self, metadata: Sequence[tuple[str, Any]]) -> bool:
        for key, value in metadata:
            if key == AUTH_METADATA_KEY and isinstance(value, str):
                return bearer_matches(value, self._token)
        return False


async def _deny(request: Any, context: Any) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")


def _denying_handler(handler: Any) -> Any:
    # Same streaming shape as the real method, so that the server reads the call as the client
    # sends it; the request stays raw bytes (never parsed for an unauthenticated caller).
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_deny)
    return grpc.unary_unary_rpc_method_handler(_deny)
