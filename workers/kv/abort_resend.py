"""`AbortPrefill` for every quarantined transfer, sent at once and re-sent every interval until
its pages are freed (`workers.kv.quarantine`).

The prefill worker answers each copy with its submitted count (`AbortAcknowledged`), also for a
transfer it ended or never saw (0), so a lost message or a restarted worker only delays the
release. The sends double as the liveness evidence of the prefill address
(`workers.kv.peer_liveness`): one that fails with a proof of death frees the address's pages,
one that misses its deadline, or stays uncompleted for ``stall_s``, has the address probed
instead of sending to it again. None goes once the fabric is abandoned (the pages stay held).
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from functools import partial

from workers.fabric import FabricError, OperationTimeoutError, PeerFailedError, TransferEngine
from workers.kv.peer_liveness import PeerLiveness
from workers.kv.protocol import AbortPrefill, encode_message
from workers.kv.quarantine import PageQuarantine

# Floor of the re-send interval (the drain interval may be 0: no message storm).
_MIN_RESEND_S = 0.05
# An AbortPrefill not completed after max(drain interval, this) means the peer takes no
# messages.
_MIN_STALL_S = 0.5


def resend_interval_s(drain_interval_s: float) -> float:
    """How often an abort is re-sent (`PageQuarantine`'s interval) for a drain interval."""
    return max(drain_interval_s, _MIN_RESEND_S)


class AbortResender:
    """Step thread; the fabric's completions of the sends only enqueue (and wake it)."""

    def __init__(
        self,
        fabric: TransferEngine,
        quarantine: PageQuarantine,
        liveness: PeerLiveness,
        drain_interval_s: float,
        wake: Callable[[], None],
        key: bytes | None = None,
    ) -> None:
        """An abort neither completed nor failed after max(``drain_interval_s``, 0.5 s) means
        its peer takes no messages: the peer is probed instead of sent to. ``key``: the
        cluster's secret (`workers.kv.protocol`)."""
        self._fabric = fabric
        self._key = key
        self._quarantine = quarantine
        self._liveness = liveness
        self._stall_s = max(drain_interval_s, _MIN_STALL_S)
        self._wake = wake
        # (address, error or None) of each AbortPrefill send.
        self._outcomes: queue.SimpleQueue[tuple[bytes, FabricError | None]] = queue.SimpleQueue()

    def take_outcomes(self) -> None:
        """Hand the sends completed since the last call to the liveness judgement."""
        while True:
            try:
                address, error = self._outcomes.get_nowait()
            except queue.Empty:
                break
            self._liveness.abort_completed(address, error)

    def send_due(self, now: float) -> None:
        """(Re-)send AbortPrefill for each quarantined transfer that is due, unless its prefill
        process is known gone (then its pages are freed) or not taking messages (probed)."""
        if self._fabric.closed_reason() is not None:
            return
        for pages in self._quarantine.aborts_due(now):
            if pages.imm not in self._quarantine:
                continue  # freed by the judgement of an earlier one to the same address
            address = pages.peer
            watch = self._liveness.askable(address, f"AbortPrefill for {pages.request_id} not sent")
            if watch is None:
                continue
            if watch.sent_s and now - watch.sent_s[0] >= self._stall_s:
                self._liveness.probe(
                    address, watch
                )  # an earlier abort neither completed nor failed
                continue
            try:
                self._fabric.submit_send(
                    self._fabric.add_peer(address),
                    encode_message(AbortPrefill(pages.request_id, pages.imm), self._key),
                    on_done=partial(self._on_sent, address, None),
                    on_error=partial(self._on_sent, address),
                )
            except PeerFailedError as error:  # failed meanwhile: judged by the recorded cause
                cause = self._fabric.peer_failure(address)
                self._liveness.judge(
                    address, cause or OperationTimeoutError(f"cause unknown: {error}")
                )
            except FabricError as error:
                self._liveness.judge(address, error)
            else:
                watch.sent_s.append(now)

    def _on_sent(self, address: bytes, error: FabricError | None) -> None:
        self._outcomes.put((address, error))  # fabric callback thread: enqueue only
        self._wake()
