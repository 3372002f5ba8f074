"""Host and port spelling shared by the config, the router and the workers."""

from __future__ import annotations

# Bind addresses that mean "every interface": no peer can dial them.
WILDCARD_HOSTS: frozenset[str] = frozenset({"0.0.0.0", "::"})


def join_host_port(host: str, port: int) -> str:
    """``host:port`` as clients dial it: an IPv6 host in brackets (``[::1]:50051``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
