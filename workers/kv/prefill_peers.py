"""The prefill workers a decoder asks: the fabric peer of each endpoint, keyed by its address
*and* its incarnation.

Each `PrefillEndpoint` names its worker's incarnation (a restart draws anew). An endpoint naming
another incarnation than the one last confirmed at its address may be a worker restarted there,
to which nothing cached of the old process (e.g. its failed state) applies: the peer is resolved
afresh. An incarnation is confirmed only once the worker accepted a request naming it (a worker
rejects one naming another).

Quarantined pages stay held whatever an endpoint names: an incarnation is a claim, not proof
that the old process is gone (a stale registry entry, an unversioned endpoint (0), or a request
the live worker rejects as stale name another incarnation while it can still write). A truly
restarted worker answers the re-sent `AbortPrefill` with 0 ("never seen") and a dead one shows
through its connection or its listener (`workers.kv.peer_liveness`).
"""

from __future__ import annotations

from workers.fabric import PeerHandle, TransferEngine
from workers.kv.endpoint import PrefillEndpoint


class PrefillPeers:
    def __init__(self, fabric: TransferEngine) -> None:
        self._fabric = fabric
        self.incarnations: dict[bytes, int] = {}  # address -> incarnation last confirmed there

    def peer(self, endpoint: PrefillEndpoint) -> PeerHandle:
        """The endpoint's peer, re-resolved when it names an incarnation not confirmed there."""
        known = self.incarnations.get(endpoint.address)
        if known is not None and known != endpoint.incarnation:
            self._fabric.forget_peer(endpoint.address)
        return self._fabric.add_peer(endpoint.address)

    def confirm(self, endpoint: PrefillEndpoint) -> None:
        """The worker at the endpoint's address accepted a request naming its incarnation: that
        incarnation serves there now."""
        if endpoint.incarnation:
            self.incarnations[endpoint.address] = endpoint.incarnation
