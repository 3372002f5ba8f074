"""The router's own address: a second router on a bound address fails to bind (no
SO_REUSEPORT sharing), and an IPv6 host is advertised in brackets."""

from __future__ import annotations

import asyncio

import pytest


def test_a_second_router_on_the_same_address_fails_to_bind() -> None:
    """gRPC's default SO_REUSEPORT would let both bind and split the clients between them."""
    from orchestrator.control.app import router_grpc_server

    async def run() -> None:
        first = router_grpc_server([], 1 << 20)
        port = first.add_insecure_port("127.0.0.1:0")
        await first.start()
        try:
            second = router_grpc_server([], 1 << 20)
            with pytest.raises(RuntimeError):
                second.add_insecure_port(f"127.0.0.1:{port}")
        finally:
            await first.stop(None)

    asyncio.run(run())


def test_an_ipv6_host_is_advertised_in_brackets() -> None:
    from orchestrator.config.sections import RouterConfig
    from workers.netaddr import join_host_port

    router = RouterConfig(address="[::1]:50051")
    assert join_host_port(router.host, router.port) == "[::1]:50051"
    assert join_host_port("127.0.0.1", 8000) == "127.0.0.1:8000"
