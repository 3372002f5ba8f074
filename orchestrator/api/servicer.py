"""``pdserve.v1.Generation``: the client API's servicer, the one place errors become status codes.

    InvalidRequestError (bad prompt / sampling, too long)  -> INVALID_ARGUMENT
    QueueFullError, CapacityError                          -> RESOURCE_EXHAUSTED
    UnavailableError (no ready worker, draining)           -> UNAVAILABLE
    WorkerFailedError (the worker died mid-request)        -> UNAVAILABLE
    DuplicateRequestError                                  -> ALREADY_EXISTS
    anything else                                          -> INTERNAL (logged)

Request bytes are checked before any handler runs (`add_generation_servicer`, with
`orchestrator.api.request_checks`): oversized, corrupt, invalid UTF-8 or unknown fields ->
INVALID_ARGUMENT. Register the servicer with `add_generation_servicer`, never with the generated
``add_GenerationServicer_to_server`` (whose deserializer turns bad bytes into INTERNAL).

A client that cancels or whose deadline passes shows up as ``CancelledError`` in the stream;
the router's ``finally`` aborts the request on its worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from orchestrator.api.request_checks import MalformedRequest, checked_deserializer
from orchestrator.control.registry import Registry, ScaleResult
from orchestrator.errors import (
    CapacityError,
    DuplicateRequestError,
    InvalidRequestError,
    QueueFullError,
    ScaleInProgressError,
    UnavailableError,
    WorkerFailedError,
)
from orchestrator.router.core import Router
from orchestrator.router.types import GenerationInput, StreamEvent
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

GENERATION_SERVICE = "pdserve.v1.Generation"
Req = TypeVar("Req")
Resp = TypeVar("Resp")

_STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (WorkerFailedError, grpc.StatusCode.UNAVAILABLE),
    (DuplicateRequestError, grpc.StatusCode.ALREADY_EXISTS),
    (ScaleInProgressError, grpc.StatusCode.FAILED_PRECONDITION),
)
_ROLES = {
    "prefill": pb.WORKER_ROLE_PREFILL,
    "decode": pb.WORKER_ROLE_DECODE,
    "mixed": pb.WORKER_ROLE_MIXED,
}
_HEALTH = {
    "starting": pb.WORKER_HEALTH_STARTING,
    "healthy": pb.WORKER_HEALTH_HEALTHY,
    "draining": pb.WORKER_HEALTH_DRAINING,
    "unhealthy": pb.WORKER_HEALTH_UNHEALTHY,
}
# SamplingParams fields that are proto3 `optional` (unset: the engine default).
_OPTIONAL_FIELDS = ("temperature", "top_p", "repetition_penalty", "seed")
_PLAIN_FIELDS = ("top_k", "min_p", "presence_penalty", "frequency_penalty", "ignore_eos")


@dataclass(frozen=True)
class GroupView:
    name: str
    role: str
    num_replicas: int
    tp_size: int


def status_of(error: BaseException) -> grpc.StatusCode:
    for kind, code in _STATUS:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


def input_from_proto(request: pb.GenerateRequest) -> GenerationInput:
    sampling: dict[str, Any] = {}
    max_tokens: int | None = None
    if request.HasField("sampling"):
        message = request.sampling
        for name in _OPTIONAL_FIELDS:
            if message.HasField(name):
                sampling[name] = getattr(message, name)
        for name in _PLAIN_FIELDS:
            sampling[name] = getattr(message, name)
        sampling["stop"] = list(message.stop)
        sampling["stop_token_ids"] = list(message.stop_token_ids)
        if message.HasField("max_tokens"):
            max_tokens = message.max_tokens
            if max_tokens < 1:
                raise InvalidRequestError(f"max_tokens must be >= 1, got {max_tokens}")
    return GenerationInput(
        request_id=request.request_id,
        prompt=request.prompt or None,
        prompt_token_ids=list(request.prompt_token_ids) or None,
        sampling=sampling,
        max_tokens=max_tokens,
        return_token_ids=request.return_token_ids,
        return_logprobs=request.return_logprobs,
    )


def response_of(event: StreamEvent) -> pb.GenerateResponse:
    response = pb.GenerateResponse(
        request_id=event.request_id,
        text=event.text,
        token_ids=event.token_ids,
        logprobs=event.logprobs,
        finish_reason=event.finish_reason,
    )
    if event.timings is not None:
        response.usage.prompt_tokens = event.num_prompt_tokens
        response.usage.completion_tokens = event.num_completion_tokens
        timings = event.timings
        response.timings.time_to_first_token_seconds = timings.time_to_first_token
        response.timings.mean_inter_token_latency_seconds = timings.mean_inter_token_latency
        response.timings.end_to_end_latency_seconds = timings.end_to_end_latency
        response.timings.queue_time_seconds = timings.queue_time
    return response


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(
        self,
        router: Router,
        model_info: pb.GetModelInfoResponse,
        groups: Sequence[GroupView],
        refresh: Callable[[], Awaitable[None]] | None = None,
        scale: Callable[[str, int], Awaitable[ScaleResult]] | None = None,
    ) -> None:
        """``scale(group, replicas)``: the control plane's (`Controller.scale`); None: this
        router cannot scale its cluster (UNIMPLEMENTED)."""
        self.router = router
        self.model_info = model_info
        self.groups = list(groups)
        self.refresh = refresh
        self.scale = scale

    @property
    def registry(self) -> Registry:
        return self.router.registry

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            async for event in self.router.generate(input_from_proto(request)):
                yield response_of(event)
        except asyncio.CancelledError:
            logger.debug("client left request %s", request.request_id or "(unnamed)")
            raise
        except Exception as error:
            code = status_of(error)
            if code is grpc.StatusCode.INTERNAL:
                logger.exception("request %s failed", request.request_id or "(unnamed)")
            await context.abort(code, str(error) or type(error).__name__)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        return self.model_info

    async def GetClusterState(
        self, request: pb.GetClusterStateRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetClusterStateResponse:
        if self.refresh is not None:
            await self.refresh()
        response = pb.GetClusterStateResponse(
            serving_mode=self.model_info.serving_mode,
            num_outstanding_requests=self.router.num_outstanding,
            num_queued_requests=self.router.num_queued,
        )
        for group in self.groups:
            state = response.groups.add(
                name=group.name,
                role=_ROLES[group.role],
                num_replicas=group.num_replicas,
                tp_size=group.tp_size,
            )
            for record in sorted(self.registry.of_role(group.role), key=lambda r: r.replica):
                load = record.load
                state.workers.add(
                    worker_id=record.worker_id,
                    role=_ROLES[record.role],
                    tp_size=record.tp_size,
                    health=_HEALTH[record.health],
                    num_running_requests=load.num_running_requests,
                    num_waiting_requests=load.num_waiting_requests,
                    num_free_kv_pages=load.num_free_kv_pages,
                    num_total_kv_pages=load.num_total_kv_pages,
                    num_transfers_in_flight=load.num_transfers_in_flight,
                    num_prompt_tokens_computed=load.num_computed_prompt_tokens,
                    num_tokens_generated=load.num_sampled_tokens,
                    node_ip=record.node_ip,
                )
        return response

    async def ScaleGroup(
        self, request: pb.ScaleGroupRequest, context: grpc.aio.ServicerContext
    ) -> pb.ScaleGroupResponse:
        if self.scale is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this router cannot scale")
        assert self.scale is not None  # abort() raises
        try:
            result = await self.scale(request.group, request.replicas)
        except Exception as error:
            code = status_of(error)
            if code is grpc.StatusCode.INTERNAL:
                logger.exception("scaling %s failed", request.group)
            await context.abort(code, str(error) or type(error).__name__)
        self.groups = [
            dataclasses.replace(g, num_replicas=result.replicas) if g.role == request.group else g
            for g in self.groups
        ]
        return pb.ScaleGroupResponse(
            replicas=result.replicas, added=result.added, removed=result.removed
        )


# --- registration: request bytes checked before the handlers ----------------------------------


def _unary_stream(
    method: Callable[[Req, grpc.aio.ServicerContext], AsyncIterator[Resp]],
) -> Callable[[Req | MalformedRequest, grpc.aio.ServicerContext], AsyncIterator[Resp]]:
    async def handler(
        request: Req | MalformedRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Resp]:
        if isinstance(request, MalformedRequest):
            logger.debug("malformed request: %s", request.reason)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        else:
            async for response in method(request, context):
                yield response

    return handler


def _unary_unary(
    method: Callable[[Req, grpc.aio.ServicerContext], Awaitable[Resp]],
) -> Callable[[Req | MalformedRequest, grpc.aio.ServicerContext], Awaitable[Resp]]:
    async def handler(request: Req | MalformedRequest, context: grpc.aio.ServicerContext) -> Resp:
        if isinstance(request, MalformedRequest):
            logger.debug("malformed request: %s", request.reason)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        assert not isinstance(request, MalformedRequest)  # abort() raises
        return await method(request, context)

    return handler


def add_generation_servicer(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    """Serve ``servicer`` as ``pdserve.v1.Generation`` on ``server``; request bytes over
    ``router.max_request_bytes``, corrupt or with unknown fields get INVALID_ARGUMENT."""
    limit = servicer.router.settings.max_request_bytes
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            _unary_stream(servicer.Generate),
            request_deserializer=checked_deserializer(pb.GenerateRequest, limit),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            _unary_unary(servicer.GetModelInfo),
            request_deserializer=checked_deserializer(pb.GetModelInfoRequest, limit),
            response_serializer=pb.GetModelInfoResponse.SerializeToString,
        ),
        "GetClusterState": grpc.unary_unary_rpc_method_handler(
            _unary_unary(servicer.GetClusterState),
            request_deserializer=checked_deserializer(pb.GetClusterStateRequest, limit),
            response_serializer=pb.GetClusterStateResponse.SerializeToString,
        ),
        "ScaleGroup": grpc.unary_unary_rpc_method_handler(
            _unary_unary(servicer.ScaleGroup),
            request_deserializer=checked_deserializer(pb.ScaleGroupRequest, limit),
            response_serializer=pb.ScaleGroupResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(GENERATION_SERVICE, handlers),)
    )
    # As the generated registration does: the registered-method fast path of grpc >= 1.62.
    server.add_registered_method_handlers(GENERATION_SERVICE, handlers)
