"""Typed errors of the engine. Mapped to gRPC / HTTP status codes only at the service edge."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request the engine will never serve as given (bad prompt, bad sampling values).

    Raised before anything is allocated for the request.
    """


class UnsupportedCheckpointError(EngineError):
    """A checkpoint directory the engine cannot load (architecture, missing files, dtype)."""


class CapacityError(EngineError):
    """No room right now (queue full, KV pool too small for the request even when empty)."""


class TensorParallelConfigError(EngineError, ValueError):
    """A tensor-parallel size the model cannot be split by (heads, KV heads, MLP width).

    Raised before any process is started.
    """


class HeadPlacementError(EngineError, ValueError):
    """KV heads that cannot be placed on a tensor-parallel group (`head_placement`): a head
    count the group size neither divides nor is a multiple of, or a rank outside the group."""


class TensorParallelError(EngineError):
    """A tensor-parallel rank failed (died, did not start, or a collective broke).

    The group cannot continue: close the engine and start a new one.
    """


class EngineClosedError(EngineError, RuntimeError):
    """The engine's step loop has stopped or died: it will run nothing more.

    Raised by `StepLoop.call` at once (``__cause__`` is the loop's error when it died).
    """


class EngineCallTimeoutError(EngineError, TimeoutError):
    """`StepLoop.call` gave up waiting for its function.

    ``started`` False: the function never ran and never will (the call was cancelled).
    ``started`` True: it was already running on the loop thread and still completes, unseen by
    the caller: whatever it started (a request) is the caller's to undo (abort).
    """

    def __init__(self, message: str, *, started: bool) -> None:
        super().__init__(message)
        self.started = started
