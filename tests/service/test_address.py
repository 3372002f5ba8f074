"""Where workers listen and what the registry advertises: loopback on one machine; on a
wildcard bind (``worker_host: 0.0.0.0``, the Helm chart) the node's IP, which the router on
another pod can dial. A worker server on the IPv6 wildcard (``worker_host: "::"``) binds
and reports its address with the host in brackets (grpc refuses ``":::0"``)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import grpc
import pytest
import ray.util

from orchestrator.config.cluster import ClusterConfig
from orchestrator.control.controller import Controller
from orchestrator.control.registry import Registry
from protos.pdserve.v1 import worker_pb2 as wpb
from protos.pdserve.v1 import worker_pb2_grpc as wpb_grpc
from tests.fakes import FakeIdleBackend
from workers.service.actor import advertised_address
from workers.service.server import WorkerServer, WorkerServicer


@pytest.fixture
def node_ip(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    ips = ["10.4.0.17"]
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: ips[0])
    return ips


def test_a_specific_host_is_advertised_as_it_is(node_ip: list[str]) -> None:
    assert advertised_address("127.0.0.1", 40123) == "127.0.0.1:40123"
    assert advertised_address("10.9.9.9", 1) == "10.9.9.9:1"
    assert advertised_address("::1", 40123) == "[::1]:40123"


def test_a_wildcard_advertises_the_node_ip(node_ip: list[str]) -> None:
    assert advertised_address("0.0.0.0", 40123) == "10.4.0.17:40123"
    node_ip[0] = "fd00::17"
    assert advertised_address("::", 40123) == "[fd00::17]:40123"


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_controller_hands_worker_host_to_every_worker(tmp_path: Path, host: str) -> None:
    config = ClusterConfig.from_dict(
        {
            "model": str(tmp_path / "absent"),  # model rules skipped: nothing is loaded here
            "worker_host": host,
            "groups": {"prefill": {}, "decode": {"fabric": {"node": "127.0.0.1"}}},
        }
    )
    controller = Controller(config, Registry())
    for group in config.groups:
        assert controller._spec(group, f"{group.role}-0").host == host


def ipv6_unavailable() -> str | None:
    """Why this machine cannot bind ``::`` and dial ``::1`` (None: it can)."""
    if not socket.has_ipv6:
        return "Python was built without IPv6 support (socket.has_ipv6 is False)"
    for host in ("::", "::1"):
        try:
            with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
        except OSError as error:
            return f"this machine cannot bind an IPv6 socket to {host!r}: {error}"
    return None


def test_a_worker_server_on_the_ipv6_wildcard_binds_and_reports_a_bracketed_address() -> None:
    reason = ipv6_unavailable()
    if reason is not None:
        pytest.skip(reason)
    servicer = WorkerServicer("mixed-0", FakeIdleBackend())
    server = WorkerServer(servicer, host="::", port=0)
    try:
        assert server.port > 0
        assert server.address == f"[::]:{server.port}"

        async def state() -> wpb.GetWorkerStateResponse:
            async with grpc.aio.insecure_channel(f"[::1]:{server.port}") as channel:
                stub = wpb_grpc.WorkerStub(channel)
                response: wpb.GetWorkerStateResponse = await stub.GetWorkerState(
                    wpb.GetWorkerStateRequest(), timeout=30
                )
                return response

        response = asyncio.run(state())
        assert (response.worker_id, response.num_free_kv_pages) == ("mixed-0", 7)
    finally:
        server.stop(0.1)
        servicer.close()
