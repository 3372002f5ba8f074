"""Is a `tcp` fabric peer's process gone? Ask its listening socket.

A decoder must not free the pages of an aborted transfer while the prefill process could still
post a write into them (`workers.kv.quarantine`). On ``tcp;ofi_rxm`` a killed peer is not
reported as such: a send to it is retried (EAGAIN) until the fabric's operation deadline and
then fails like a send to a merely stalled peer (`OperationTimeoutError`). The peer's listening
socket tells the two apart: it closes with the process (a connect is refused), while the kernel
keeps accepting connections for a stopped (SIGSTOP), descheduled or swapped process.

`listener_refuses` connects once and closes at once, without a byte sent (rxm's listener drops
such a connection); it is only asked about a peer whose control messages stopped completing.
"""

from __future__ import annotations

import errno
import re
import socket

# `fi_av_straddr` names of `tcp` addresses (`PeerHandle.name`).
_TCP_NAME = re.compile(r"^fi_sockaddr_in6?://\[?(?P<host>[^\]]+?)\]?:(?P<port>\d+)$")


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
        try:
            code = probe.connect_ex((host, port))
        except OSError:
            return False
    return code == errno.ECONNREFUSED
