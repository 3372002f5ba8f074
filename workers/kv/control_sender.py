"""Control messages from a prefill worker to its decoders, counted until the fabric is done
with them: a graceful close waits (bounded) until none is in flight (`PrefillMessenger.
is_drained`), so a decoder is told of every transfer given up while draining.

A message the fabric does not deliver is only logged: every decoder message that matters is
repeated or backed by a deadline on the decoder's side (re-sent aborts, its transfer deadline).
"""

from __future__ import annotations

import logging
import threading
from functools import partial

from workers.fabric import FabricError, PeerHandle, TransferEngine
from workers.kv.protocol import Message, encode_message

log = logging.getLogger(__name__)


class ControlSender:
    def __init__(self, fabric: TransferEngine, key: bytes | None = None) -> None:
        """``key``: the cluster's secret, whose MAC every message carries (`workers.kv.protocol`)."""
        self._fabric = fabric
        self._key = key
        self._lock = threading.Lock()
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def send(self, peer: PeerHandle, message: Message) -> None:
        with self._lock:
            self._in_flight += 1
        try:
            self._fabric.submit_send(
                peer,
                encode_message(message, self._key),
                on_done=self._on_done,
                on_error=partial(self._on_error, peer.name),
            )
        except FabricError as error:
            self._on_done()
            log.warning("could not send %s to %s: %s", type(message).__name__, peer.name, error)

    def _on_done(self) -> None:  # fabric callback thread
        with self._lock:
            self._in_flight -= 1

    def _on_error(self, peer_name: str, error: FabricError) -> None:  # fabric callback thread
        self._on_done()
        log.info("control message to %s not delivered: %s", peer_name, error)
