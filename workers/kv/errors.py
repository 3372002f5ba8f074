"""Typed errors of the KV messenger's logic layer.

Each one fails a single transfer (its request), never the process; the messenger maps them to a
`PrefillRejected` / request failure at its edge.
"""

from __future__ import annotations


class KvTransferError(Exception):
    """Base class of every error the KV messenger raises on purpose."""


class ShardingError(KvTransferError, ValueError):
    """A prefill/decode group pair whose KV sharding cannot be mapped onto each other, or a
    page, pool or plan that does not fit the mapping.

    A single group whose heads cannot be placed at all is the engine's `HeadPlacementError`
    (`workers.engine.head_placement`): callers that build a group from a peer's message turn
    it into their own error.
    """


class ImmError(KvTransferError, ValueError):
    """An immediate-data layout or value that does not fit the rules (bits, slot, generation)."""


class SlotsExhaustedError(KvTransferError):
    """Every transfer slot is live: the decoder cannot start another transfer right now."""


class ProtocolError(KvTransferError, ValueError):
    """A control message that is malformed, of an unknown version, or violates the schema."""


class UnauthenticatedMessageError(ProtocolError):
    """A control message without a valid MAC of the cluster's secret (`workers.kv.protocol`)."""


class IllegalTransitionError(KvTransferError):
    """A transfer state machine was asked to move along an edge its table does not have."""


class AdmissionTimeoutError(KvTransferError):
    """A decode request waited longer than its admission deadline for pages / a transfer slot."""


class KVChecksumError(KvTransferError):
    """Checksum mode: the KV that landed on the decoder differs from what the prefill summed
    (`workers.kv.checksum`); the request fails instead of decoding from corrupt KV."""
