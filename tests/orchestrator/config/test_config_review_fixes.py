"""Review fixes of the cluster config: device auto on GPUs, port digits, loopback clashes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import ClusterConfig, ConfigError, RouterConfig
from tests.orchestrator.test_config import SMOLLM2_SHAPE, base_dict, write_model


@pytest.fixture
def raw(tmp_path: Path) -> dict[str, Any]:
    return base_dict(write_model(tmp_path / "smol", **SMOLLM2_SHAPE))


def _gpu_groups(raw: dict[str, Any], device: str, gpu: float, provider: str) -> dict[str, Any]:
    raw["device"] = device
    for role in ("prefill", "decode"):
        raw["groups"][role]["resources_per_rank"] = {"cpu": 1, "gpu": gpu}
        raw["groups"][role]["fabric"] = {"provider": provider}
    return raw


# --- device auto --------------------------------------------------------------------------


@pytest.mark.parametrize("gpu", [1, 0.5])
def test_auto_device_on_gpus_needs_a_gpu_memory_provider(raw: dict[str, Any], gpu: float) -> None:
    # auto resolves to cuda on a rank that reserves a GPU: tcp would fail only at worker start.
    with pytest.raises(ConfigError) as caught:
        ClusterConfig.from_dict(_gpu_groups(raw, "auto", gpu, "tcp"))
    assert caught.value.path == "groups.prefill.fabric.provider"
    assert "cannot register GPU memory" in str(caught.value)
    assert "device auto" in str(caught.value)


def test_auto_device_on_one_gpu_group_is_checked(raw: dict[str, Any]) -> None:
    raw["device"] = "auto"
    raw["groups"]["decode"]["resources_per_rank"] = {"cpu": 1, "gpu": 1}
    with pytest.raises(ConfigError, match=r"^groups\.decode\.fabric\.provider: tcp;ofi_rxm "):
        ClusterConfig.from_dict(raw)


@pytest.mark.parametrize(
    ("device", "gpu", "provider"),
    [
        ("auto", 0, "tcp"),  # no GPU reserved: auto is cpu there
        ("auto", 1, "verbs"),
        ("auto", 1, "efa"),
        ("cpu", 1, "tcp"),  # GPUs reserved, engines on the CPU: KV in host memory
    ],
)
def test_auto_and_cpu_devices_take_what_can_serve(
    raw: dict[str, Any], device: str, gpu: float, provider: str
) -> None:
    config = ClusterConfig.from_dict(_gpu_groups(raw, device, gpu, provider))
    assert config.device == device


# --- port digits --------------------------------------------------------------------------


@pytest.mark.parametrize("port", ["5²", "５００５１", "٥٠٠٥١", "1_000"])
def test_port_of_non_ascii_digits_is_a_config_error(raw: dict[str, Any], port: str) -> None:
    raw["router"]["address"] = f"127.0.0.1:{port}"
    with pytest.raises(ConfigError) as caught:
        ClusterConfig.from_dict(raw)
    assert caught.value.path == "router.address"
    assert "port in 0-65535" in str(caught.value)
    with pytest.raises(ConfigError, match=r"^http_address: "):
        RouterConfig(http_address=f"127.0.0.1:{port}")


# --- loopback clashes ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("grpc", "http"),
    [
        ("localhost:8000", "127.0.0.1:8000"),
        ("127.0.0.1:8000", "localhost:8000"),
        ("LocalHost:8000", "[::1]:8000"),
        ("localhost:8000", "LOCALHOST:8000"),
    ],
)
def test_loopback_names_on_one_port_clash(raw: dict[str, Any], grpc: str, http: str) -> None:
    raw["router"] = {"address": grpc, "http_address": http}
    with pytest.raises(ConfigError) as caught:
        ClusterConfig.from_dict(raw)
    assert caught.value.path == "router.http_address"
    assert "is the gRPC address's port too" in str(caught.value)


@pytest.mark.parametrize(
    ("grpc", "http"),
    [
        ("localhost:8000", "localhost:8001"),
        ("127.0.0.1:8000", "[::1]:8000"),  # separate sockets: IPv4 and IPv6 loopback
        ("127.0.0.1:8000", "10.0.0.1:8000"),
        ("localhost:0", "127.0.0.1:0"),  # port 0: each its own free port
    ],
)
def test_distinct_binds_do_not_clash(grpc: str, http: str) -> None:
    assert RouterConfig(address=grpc, http_address=http).http_address == http
