"""Which NICs carry a request's KV writes when a prefill worker or its decoder has several
(`workers.fabric.nics`).

A *lane* is a pair (prefill NIC, decoder NIC). With ``P`` prefill NICs and ``D`` decoder NICs
there are ``L = lcm(P, D)`` lanes: lane ``k`` goes from prefill NIC ``k mod P`` to decoder NIC
``k mod D``, so every NIC of either side is in as many lanes as any other. Each request's
page writes go through one lane, the next one round-robin, starting at a random lane per
prefill worker (so prefill workers feeding one decoder do not all begin on its first NIC).

Why one lane per request rather than striping each request's layers over the NICs: the writes
of a request stay the `PreparedWrites` of one engine per rank pair, prepared before the pass
and queued per layer as with one NIC (`workers.kv.push`), and concurrent requests spread evenly
over the NICs. The cost: one request alone moves at one NIC pair's bandwidth. Round-robin
rather than a random draw per request: the same spread on average, without a run of requests
on one NIC by chance.

Whichever NIC they land on, the writes count under the request's one imm (the decoder's NICs
share their counters), so the expected count, deadlines, aborts and the quarantine are those of
one NIC. The context write (and every control message) stays on the primary NICs: the
decoder's context buffer is registered with its primary engine only.

With one NIC on each side there is one lane, the primary pair: the peer and descriptors are the
ones a single-NIC worker used, so nothing changes.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from workers.fabric import MemoryRegionDescriptor, PeerHandle, TransferEngine
from workers.kv.prefill_checks import CheckedRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lane:
    """Where a request's page writes go."""

    nic: int  # the prefill NIC: index into `PrefillSide.nics` (0: the primary)
    peer: PeerHandle  # the decoder NIC's endpoint, as that prefill NIC's engine knows it
    dst_descriptors: tuple[MemoryRegionDescriptor, ...]  # the decoder's pools on that NIC


class LanePicker:
    def __init__(self, nics: Sequence[TransferEngine], rng: random.Random | None = None) -> None:
        """``nics``: this worker's engines, the primary first (`PrefillSide.nics`)."""
        self._nics = tuple(nics)
        self._next = (rng or random.SystemRandom()).randrange(1 << 30)

    def pick(self, checked: CheckedRequest, peer: PeerHandle) -> Lane:
        """The lane of the next request, ``checked`` from the decoder whose primary NIC is
        ``peer`` (on the primary engine). Raises `FabricError` when a decoder NIC's address is
        not one this worker's engine can use (the request is then refused)."""
        request = checked.request
        num_dst = 1 + len(request.nic_addresses)
        lane = self._next % math.lcm(len(self._nics), num_dst)
        self._next += 1
        nic, dst_nic = lane % len(self._nics), lane % num_dst
        if dst_nic == 0:
            descriptors = checked.dst_descriptors
            if nic == 0:
                return Lane(0, peer, descriptors)
            address = peer.address
        else:
            descriptors = checked.nic_descriptors[dst_nic - 1]
            address = request.nic_addresses[dst_nic - 1]
        return Lane(nic, self._peer(self._nics[nic], address), descriptors)

    def forget(self, addresses: Sequence[bytes]) -> None:
        """Drop what every engine caches of ``addresses`` (a decoder's NICs): its process was
        replaced (`DecoderPeers.replaced`)."""
        for engine in self._nics:
            for address in addresses:
                engine.forget_peer(address)

    @staticmethod
    def _peer(engine: TransferEngine, address: bytes) -> PeerHandle:
        # A request from the decoder proves it alive: a failed state this engine keeps for one
        # of its NICs (an op that missed its deadline while it was stalled) is resolved afresh,
        # as `DecoderPeers.sender` does for its primary.
        failure = engine.peer_failure(address)
        if failure is not None:
            log.info("decoder NIC marked failed (%s): resolving it afresh", failure)
            engine.forget_peer(address)
        return engine.add_peer(address)
