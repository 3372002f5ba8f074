"""Typed errors of the router and control plane, mapped to gRPC status codes once, in
`orchestrator.api.servicer` (never raised as status codes inside)."""

from __future__ import annotations

from workers.engine.errors import CapacityError, InvalidRequestError

__all__ = [
    "CapacityError",
    "ContextLengthError",
    "DuplicateRequestError",
    "InvalidRequestError",
    "QueueFullError",
    "RouterError",
    "ScaleInProgressError",
    "UnavailableError",
    "WorkerFailedError",
]


class RouterError(Exception):
    """Base class of the router's own errors."""


class QueueFullError(RouterError):
    """Every worker is at capacity and the router's queue holds ``max_queue`` requests."""


class UnavailableError(RouterError):
    """No ready worker of a needed role, or the router is draining."""


class DuplicateRequestError(RouterError):
    """A request with this id is already in flight."""


class ScaleInProgressError(RouterError):
    """A group's size is being changed already (one scale at a time)."""


class WorkerFailedError(RouterError):
    """The worker serving a request failed or left service mid-request."""


class ContextLengthError(InvalidRequestError):
    """The prompt plus an explicit max_tokens exceed max_model_len
    (`orchestrator.router.types.GenerationInput.max_tokens_within_context`)."""
