"""Where workers listen and what the registry advertises: loopback on one machine; on a
wildcard bind (``worker_host: 0.0.0.0``, the Helm chart) the node's IP, which the router on
another pod can dial."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray.util

from orchestrator.config import ClusterConfig
from orchestrator.controller import Controller
from orchestrator.registry import Registry
from orchestrator.worker_actor import advertised_address


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
