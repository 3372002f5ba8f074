"""The OpenAI-compatible HTTP front of the router (aiohttp, in the router's event loop).

    POST /v1/completions, /v1/chat/completions   JSON, or SSE with ``stream: true``
    GET  /v1/models, /v1/models/{id}, /health

Requests run through the same `Router.generate` as the gRPC servicer (same queue, policy,
metrics); `orchestrator.api.openai_protocol` translates bodies and events. Errors become HTTP
statuses only here, in OpenAI's shape ``{"error": {"message", "type", "code"}}``:

    InvalidRequestError (bad body, sampling, context overflow)  -> 400
    UnsupportedParameterError (tools, logit_bias, ...)          -> 400 (``param`` names it)
    ContextLengthError (prompt + explicit max_tokens too long)  -> 400 (context_length_exceeded)
    a body over ``router.max_request_bytes``                    -> 400 (code request_too_large)
    CapacityError (the prompt never fits a KV pool)             -> 400
    missing / wrong bearer token (``router.auth.token``)        -> 401
    unknown model                                               -> 404
    unknown path, wrong method (aiohttp's HTTPException)        -> its status (404, 405, ...)
    QueueFullError                                              -> 429
    UnavailableError, WorkerFailedError (draining, no worker)   -> 503
    anything else                                               -> 500 (logged)

A streamed request fails with a status while nothing was sent (the first event is awaited
before the response starts); after that, an error is one ``data: {"error": ...}`` event and
the stream ends without ``[DONE]``. A client that leaves (its connection closes) cancels its
handler (``handler_cancellation``; aiohttp's default lets a handler run on without a reader:
a non-streamed request until ``max_tokens``, a queued one until admitted and prefilled), which
closes the router's generator, whose ``finally`` aborts the request on its worker.
"""

from __future__ import annotations

import contextlib
import json
import logging
import ssl
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from orchestrator.api.openai_protocol import (
    ParsedRequest,
    UnsupportedParameterError,
    completion_response,
    model_entry,
    models_response,
    parse_request,
    stream_chunk,
    usage_chunk,
)
from orchestrator.errors import (
    CapacityError,
    ContextLengthError,
    DuplicateRequestError,
    InvalidRequestError,
    QueueFullError,
    UnavailableError,
    WorkerFailedError,
)
from orchestrator.router.core import Router
from orchestrator.router.types import StreamEvent
from workers.netaddr import join_host_port
from workers.token_auth import bearer_matches

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# (error type, HTTP status, OpenAI error type, code), first match wins.
_ERRORS: tuple[tuple[type[BaseException], int, str, str], ...] = (
    (UnsupportedParameterError, 400, "invalid_request_error", "unsupported_parameter"),
    (ContextLengthError, 400, "invalid_request_error", "context_length_exceeded"),
    (InvalidRequestError, 400, "invalid_request_error", "invalid_request"),
    (CapacityError, 400, "invalid_request_error", "context_length_exceeded"),
    (DuplicateRequestError, 409, "invalid_request_error", "duplicate_request"),
    (QueueFullError, 429, "rate_limit_error", "queue_full"),
    (UnavailableError, 503, "service_unavailable", "unavailable"),
    (WorkerFailedError, 503, "service_unavailable", "worker_failed"),
)


class ModelNotFoundError(Exception):
    """The request names a model this router does not serve."""


def error_body(status: int, message: str, kind: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": code, "param": None}}


def error_of(error: BaseException) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error JSON of a typed error (the one mapping)."""
    message = str(error) or type(error).__name__
    if isinstance(error, ModelNotFoundError):
        return 404, error_body(404, message, "invalid_request_error", "model_not_found")
    for kind, status, type_name, code in _ERRORS:
        if isinstance(error, kind):
            body = error_body(status, message, type_name, code)
            body["error"]["param"] = getattr(error, "param", None)
            return status, body
    return 500, error_body(500, "internal error", "internal_error", "internal_error")


def _error_response(error: BaseException) -> web.Response:
    status, body = error_of(error)
    if status == 500:
        logger.error("request failed", exc_info=error)
    return web.json_response(body, status=status)


def _http_error(request: web.Request, error: web.HTTPException) -> web.Response:
    """aiohttp's own refusals (no route, wrong method) in OpenAI's shape, not its plain text,
    so that clients raise their usual errors (``openai.NotFoundError``, ...)."""
    if error.status == 404:
        message, code = f"Invalid URL ({request.method} {request.path})", "not_found"
    elif error.status == 405:
        message = f"method {request.method} is not allowed on {request.path}"
        code = "method_not_allowed"
    else:
        message, code = error.reason, "http_error"
    headers = {"Allow": error.headers["Allow"]} if "Allow" in error.headers else None
    body = error_body(error.status, message, "invalid_request_error", code)
    return web.json_response(body, status=error.status, headers=headers)


def _too_large(limit: int) -> web.Response:
    """400 rather than aiohttp's plain-text 413: every bad input is a 400 in OpenAI's shape, so
    clients handle this one as they do the others (``openai.BadRequestError``)."""
    message = f"the request body exceeds the router's limit of {limit} bytes"
    body = error_body(400, message, "invalid_request_error", "request_too_large")
    return web.json_response(body, status=400)


@dataclass(frozen=True)
class HttpSettings:
    model_name: str
    auth_token: str | None = None


class OpenAIHttpApi:
    """The aiohttp application over one `Router`."""

    def __init__(self, router: Router, settings: HttpSettings) -> None:
        self.router = router
        self.settings = settings
        self.created = int(time.time())
        self.app = web.Application(
            middlewares=[self._errors, self._auth],
            client_max_size=router.settings.max_request_bytes,
        )
        self.app.router.add_post("/v1/completions", self._completions)
        self.app.router.add_post("/v1/chat/completions", self._chat)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/v1/models/{model_id:.+}", self._model)  # ids may hold "/"
        self.app.router.add_get("/health", self._health)
        self._runner: web.AppRunner | None = None
        self.address = ""

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> str:
        """Listen on ``host:port`` (0: any free port), over HTTPS with ``ssl_context``
        (`orchestrator.api.security.ServerTLS`); returns the bound ``host:port``."""
        self._runner = runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
        await site.start()
        bound = runner.addresses[0]
        self.address = join_host_port(host, bound[1])
        return self.address

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # --- middleware ------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as error:
            if error.status < 400:  # a redirect is no error
                raise
            return _http_error(request, error)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        token = self.settings.auth_token
        if token is None or request.path == "/health":
            return await handler(request)
        if not bearer_matches(request.headers.get("Authorization", ""), token):
            body = error_body(401, "invalid or missing API key", "authentication_error", "")
            body["error"]["code"] = "invalid_api_key"
            return web.json_response(body, status=401)
        return await handler(request)

    # --- routes ----------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        router = self.router
        ready = bool(router.registry.ready(router.settings.serving_role))
        if router.draining or not ready:
            return web.json_response({"status": "unavailable"}, status=503)
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(models_response(self.settings.model_name, self.created))

    async def _model(self, request: web.Request) -> web.Response:
        model_id = request.match_info["model_id"]
        if model_id != self.settings.model_name:
            return _error_response(ModelNotFoundError(f"model {model_id!r} is not served here"))
        return web.json_response(model_entry(model_id, self.created))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        try:
            try:
                body = await request.json()
            except ValueError:  # bad JSON or UTF-8, or an integer of over 4300 digits
                raise InvalidRequestError("the request body is not valid JSON") from None
            except web.HTTPRequestEntityTooLarge:
                return _too_large(self.router.settings.max_request_bytes)
            parsed = parse_request(kind, body, self.settings.model_name, self.router.tokenizer)
            if parsed.model != self.settings.model_name:
                raise ModelNotFoundError(f"model {parsed.model!r} is not served here")
            events = self.router.generate(parsed.generation)
            if parsed.stream:
                return await self._stream(request, parsed, events)
            async with contextlib.aclosing(events):
                collected = [event async for event in events]
        except Exception as error:
            return _error_response(error)
        tokenizer = self.router.tokenizer
        return web.json_response(completion_response(parsed, collected, tokenizer))

    async def _stream(
        self,
        request: web.Request,
        parsed: ParsedRequest,
        events: AsyncGenerator[StreamEvent, None],
    ) -> web.StreamResponse:
        async with contextlib.aclosing(events):
            first = await anext(events)  # errors before any byte is sent: a status
            response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            try:  # every write, the headers' included, fails once the client left
                await response.prepare(request)
                await self._send_events(response, parsed, first, events)
            except ConnectionResetError:
                logger.debug("client left stream %s", parsed.generation.request_id)
            return response

    async def _send_events(
        self,
        response: web.StreamResponse,
        parsed: ParsedRequest,
        first: StreamEvent,
        events: AsyncGenerator[StreamEvent, None],
    ) -> None:
        """SSE chunks from ``first`` on, then usage and ``[DONE]``; a failure of the request is
        the last event."""
        created = int(time.time())
        tokenizer = self.router.tokenizer
        event = first
        try:
            while True:
                await _send(response, stream_chunk(parsed, event, created, tokenizer))
                if event.timings is not None:
                    break
                event = await anext(events)
        except ConnectionResetError:
            raise
        except Exception as error:
            status, body = error_of(error)
            if status == 500:
                logger.error("stream failed", exc_info=error)
            await _send(response, body)
            return
        if parsed.include_usage:
            await _send(response, usage_chunk(parsed, event, created))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()


async def _send(response: web.StreamResponse, body: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(body).encode() + b"\n\n")
