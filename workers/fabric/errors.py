"""Typed errors of the fabric data plane.

Everything raised by `workers.fabric` (or handed to an `on_error` callback) is a `FabricError`,
so callers can map the whole family once at their boundary.
"""

from __future__ import annotations


class FabricError(Exception):
    """Base class of every error of the fabric layer."""


class FabricUnavailableError(FabricError):
    """The native binding or the requested provider is not usable on this machine."""


class ProviderError(FabricError):
    """A libfabric call failed; `code` is the positive libfabric/errno code."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class EngineClosedError(FabricError):
    """The engine was closed before (or while) the operation ran."""


class RegistrationError(FabricError):
    """A buffer cannot be registered (wrong type, not contiguous, device memory without FI_HMEM)."""


class OutOfRangeError(FabricError):
    """A write would touch bytes outside the local region or the remote descriptor's extent."""


class DescriptorError(FabricError):
    """A serialized descriptor is malformed, of another version, or from another provider."""


class AddressError(FabricError):
    """A peer address is malformed or cannot be inserted into the address vector."""


class PeerFailedError(FabricError):
    """The peer stopped answering (connection error or an operation deadline passed)."""


class TransferError(FabricError):
    """An operation completed with an error entry on the completion queue."""

    def __init__(self, message: str, code: int = 0, provider_errno: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.provider_errno = provider_errno


class OperationTimeoutError(PeerFailedError):
    """An operation did not complete before its deadline. No proof that the peer's process
    is gone: a stopped or slow one misses deadlines too."""


class PeerStuckError(OperationTimeoutError):
    """A post to the peer never returned and the watchdog abandoned the engine. No proof that
    the peer's process is gone either: on shm, a peer stopped while it held its region lock
    blocks every post to it."""


class SubmitQueueFullError(FabricError):
    """The bounded submission queue stayed full for the whole `submit_timeout`."""


class MessageTooLargeError(FabricError):
    """A two-sided message exceeds the engine's `max_message_bytes`."""


class ImmError(FabricError):
    """Misuse of the immediate-data counters (value too wide, already armed, bad count)."""


class ImmTimeoutError(FabricError):
    """An armed immediate counter did not reach its count before its timeout."""


class NicError(FabricUnavailableError):
    """A NIC entry (`workers.fabric.nics`) names neither an interface nor an address of this
    host, or several entries name one address."""
