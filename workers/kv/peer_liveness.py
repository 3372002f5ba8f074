"""Is a prefill worker's process gone? The decoder's judgement of its prefill peers.

A decoder must not free the pages of an aborted transfer while the prefill process could still
post a write into them (`workers.kv.quarantine`), and a prefill process that dies sends nothing,
so its live transfers would only end at their deadline. `PeerLiveness` judges each prefill
address on evidence, never on time:

- the fabric's failure record: a failed connection or an exited ``shm`` process
  (`PeerFailedError`) proves it gone; a missed operation deadline (`OperationTimeoutError`) does
  not (stopped and dead peers both miss deadlines), it is only a reason to probe;
- an `AbortPrefill` not completed for an interval (`workers.kv.abort_resend`), or, every
  liveness interval, no write landing for any live transfer to it (`check_stalled`): a probe;
- a probe (`listener_refuses`, off the step thread: a connect may take up to its timeout). On
  ``tcp;ofi_rxm`` a killed peer is not reported as such: a send to it is retried (EAGAIN) until
  the fabric's operation deadline and then fails like a send to a merely stalled peer. The
  peer's listening socket tells the two apart: it closes with the process (a connect is
  refused), while the kernel keeps accepting connections for a stopped (SIGSTOP), descheduled
  or swapped process. It connects once and resets the connection at once, without a byte sent:
  the provider then drops it, where a plain close (FIN) leaves the socket in libfabric 1.17's
  tcp poll set, readable for good, and the probed worker's progress thread would spin a core
  from then on (its engine notices and naps instead, `workers.fabric.completions`). A peer
  found alive that missed a deadline is resolved afresh, so the next send to it does not fail
  on the old record.

Gone, the address is handed to ``on_gone`` (the messenger fails its transfers and frees its
quarantined pages). A slow or paused prefill worker still accepts: its transfers wait, as
before, for their writes or their deadline, and its pages stay quarantined until it answers.
"""

from __future__ import annotations

import errno
import logging
import queue
import re
import socket
import struct
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from workers.fabric import (
    AddressError,
    FabricError,
    OperationTimeoutError,
    PeerFailedError,
    TransferEngine,
)

log = logging.getLogger(__name__)

# `fi_av_straddr` names of `tcp` addresses (`PeerHandle.name`).
_TCP_NAME = re.compile(r"^fi_sockaddr_in6?://\[?(?P<host>[^\]]+?)\]?:(?P<port>\d+)$")


def proves_gone(error: FabricError | None) -> bool:
    """Whether a fabric failure on record proves the peer's process gone: a failed connection
    or an exited process does; a missed deadline (a stuck post included) does not."""
    return isinstance(error, PeerFailedError) and not isinstance(error, OperationTimeoutError)


def tcp_address(peer_name: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``tcp`` peer's name; None for any other provider's name."""
    match = _TCP_NAME.match(peer_name)
    if match is None:
        return None
    return match.group("host"), int(match.group("port"))


def listener_refuses(peer_name: str, timeout_s: float = 2.0) -> bool:
    """True only when nothing listens at the peer's ``tcp`` address any more (its process is
    gone). False when it accepts, does not answer in time, or the name is not a ``tcp`` one:
    anything short of a refusal may be a live peer, and a live peer keeps its pages held."""
    address = tcp_address(peer_name)
    if address is None:
        return False
    host, port = address
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.settimeout(timeout_s)
        # Close with a reset, not a FIN (see the module's docstring).
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        try:
            code = probe.connect_ex((host, port))
        except OSError:
            return False
    return code == errno.ECONNREFUSED


@dataclass
class PeerWatch:
    """The AbortPrefill sends to one prefill address and whether its liveness is probed."""

    name: str
    sent_s: deque[float]  # send times of the aborts not completed yet, oldest first
    probing: bool = False


class PeerLiveness:
    """Step thread only, but for the probes, which run on short-lived threads and only enqueue
    their result (and wake the step thread)."""

    def __init__(
        self,
        fabric: TransferEngine,
        on_gone: Callable[[bytes, object], None],
        wake: Callable[[], None],
    ) -> None:
        """``on_gone(address, why)``: the prefill process at ``address`` is gone."""
        self._fabric = fabric
        self._on_gone = on_gone
        self._wake = wake
        self._watches: dict[bytes, PeerWatch] = {}
        self._probe_results: queue.SimpleQueue[tuple[bytes, bool]] = queue.SimpleQueue()
        # Writes landed per live transfer (imm) at the last `check_stalled` look.
        self._marks: dict[int, int] = {}

    def name_of(self, address: bytes) -> str:
        watch = self._watches.get(address)
        return watch.name if watch is not None else address.hex()

    def check_stalled(self, waiting: Iterable[tuple[int, bytes]]) -> None:
        """``waiting``: (imm, prefill address) of every transfer waiting for writes. Probe each
        address whose every such transfer had no write land since the last look (a new one
        counts as moved), unless the fabric's record already judges it."""
        marks: dict[int, int] = {}
        stalled: dict[bytes, bool] = {}  # address -> no live transfer to it moved
        for imm, address in waiting:
            seen = self._fabric.imm_arrivals(imm)
            marks[imm] = seen
            moved = self._marks.get(imm) != seen
            stalled[address] = stalled.get(address, True) and not moved
        self._marks = marks
        for address, still in stalled.items():
            if still and (watch := self.askable(address, "liveness not checked")) is not None:
                self.probe(address, watch)

    def askable(self, address: bytes, what: str) -> PeerWatch | None:
        """The watch of a prefill address that may be asked now; None when it was judged
        instead (nobody at the address any more, or a failure on record: `judge`, where a
        missed deadline is only a reason to probe) or the fabric refused (logged as ``what``)."""
        try:
            watch = self._watch(address)
        except AddressError as error:  # resolved when the request went: nobody there now
            self._on_gone(address, error)
            return None
        except FabricError as error:
            log.warning("%s: %s", what, error)
            return None
        failure = self._fabric.peer_failure(address)
        if failure is not None:
            self.judge(address, failure)
            return None
        return watch

    def _watch(self, address: bytes) -> PeerWatch:
        watch = self._watches.get(address)
        if watch is None:
            watch = PeerWatch(self._fabric.add_peer(address).name, deque())
            self._watches[address] = watch
        return watch

    def abort_completed(self, address: bytes, error: FabricError | None) -> None:
        """An AbortPrefill to ``address`` completed or failed (oldest first); judged by
        ``error``."""
        watch = self._watches.get(address)
        if watch is not None and watch.sent_s:
            watch.sent_s.popleft()
        if error is not None:
            self.judge(address, error)

    def judge(self, address: bytes, error: FabricError) -> None:
        """Hand the address to ``on_gone`` if ``error`` proves its process gone."""
        if isinstance(error, OperationTimeoutError):
            watch = self._watches.get(address)
            if watch is not None:
                self.probe(address, watch)  # stopped and dead peers both miss deadlines
        elif proves_gone(error):  # connection failed or process exited
            self._on_gone(address, error)
        else:
            log.info("AbortPrefill not sent: %s", error)

    def probe(self, address: bytes, watch: PeerWatch) -> None:
        """Ask (off the step thread) whether anything still listens at the peer's address."""
        if watch.probing or tcp_address(watch.name) is None:
            return
        watch.probing = True

        def probe() -> None:
            self._probe_results.put((address, listener_refuses(watch.name)))
            self._wake()

        threading.Thread(target=probe, name="kv-peer-probe", daemon=True).start()

    def take_probe_results(self) -> None:
        while True:
            try:
                address, gone = self._probe_results.get_nowait()
            except queue.Empty:
                break
            self._probed(address, gone)

    def _probed(self, address: bytes, gone: bool) -> None:
        watch = self._watches.get(address)
        if watch is not None:
            watch.probing = False
        if gone:
            self._on_gone(address, "nothing listens at its address")
            return
        if isinstance(self._fabric.peer_failure(address), OperationTimeoutError):
            # Alive but missed a deadline (stopped, slow): send to it afresh next time.
            self._fabric.forget_peer(address)
            if watch is not None:
                watch.sent_s.clear()

    def forget_idle(self, held: set[bytes]) -> None:
        """Drop the watches of addresses with no quarantined pages (``held``), no abort in
        flight and no probe running."""
        for address, watch in list(self._watches.items()):
            if address not in held and not watch.sent_s and not watch.probing:
                del self._watches[address]
