"""The decoders a prefill worker hears from: the peer of each message's sender, and whether a
request comes from the process its transfers write into.

- A message proves its sender's process alive and reachable now, so a failed state the fabric
  keeps for it (an operation that missed its deadline while the decoder was stopped or slow:
  never cleared by the fabric) no longer applies; kept, every answer to it and every write for
  it would fail at once, forever. As the decoder does for a prefill peer found alive
  (`workers.kv.peer_liveness`).
- Each `PrefillRequest` names its decoder's incarnation (`decode_incarnation`): a new one at a
  known address means that process was replaced, so the transfers into the old one must stop
  (their descriptors name memory of a process that is gone) and nothing cached of it applies.
"""

from __future__ import annotations

import logging

from workers.fabric import PeerHandle, TransferEngine
from workers.kv.protocol import PrefillRequest

log = logging.getLogger(__name__)


class DecoderPeers:
    def __init__(self, fabric: TransferEngine) -> None:
        self._fabric = fabric
        self.incarnations: dict[bytes, int] = {}  # decoder address -> its last incarnation

    def sender(self, address: bytes) -> PeerHandle:
        """The peer a message came from, resolved afresh if the fabric marked it failed."""
        failure = self._fabric.peer_failure(address)
        if failure is not None:
            log.info("message from a peer marked failed (%s): resolving it afresh", failure)
            self._fabric.forget_peer(address)
        return self._fabric.add_peer(address)

    def replaced(self, request: PrefillRequest, peer: PeerHandle) -> bool:
        """Record the request's decoder incarnation; True when another one was known at its
        address (the old process's transfers must stop, then `resolve_afresh`)."""
        new = request.decode_incarnation
        old = self.incarnations.get(peer.address)
        if new:
            self.incarnations[peer.address] = new
        return bool(new) and old is not None and old != new

    def resolve_afresh(self, address: bytes) -> PeerHandle:
        """The peer at ``address`` with nothing cached of its previous process."""
        self._fabric.forget_peer(address)
        return self._fabric.add_peer(address)
