"""Every rule of the cluster config rejects with the dotted path of the offending key: ranges,
choices, rules across groups, the GPU rules (device auto included), router addresses, and the
rules that read the model's config.json."""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config.cluster import (
    ClusterConfig,
    ConfigError,
    RouterConfig,
)
from orchestrator.control.placement import worker_bundles
from tests.orchestrator.config.config_helpers import (
    SMOLLM2_SHAPE,
    base_dict,
    drop_key,
    set_key,
    write_model,
)

# --- every rule rejects with the path of the offending key ----------------------------------


REJECTIONS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    # (expected error path, mutation, a phrase of the message)
    ("model", drop_key("model"), "required"),
    ("groups", drop_key("groups"), "required"),
    ("groups.decode.tp", set_key("groups.decode.tp", 0), "must be >= 1, got 0"),
    ("groups.decode.tp", set_key("groups.decode.tp", True), "must be an integer"),
    ("groups.decode.tp", set_key("groups.decode.tp", "2"), "must be an integer"),
    ("groups.prefill.replicas", set_key("groups.prefill.replicas", 0), "must be >= 1"),
    ("groups.prefill.nice", set_key("groups.prefill.nice", -1), "must be >= 0, got -1"),
    ("groups.prefill.nice", set_key("groups.prefill.nice", 20), "must be <= 19, got 20"),
    ("groups.decode.threads", set_key("groups.decode.threads", 0), "must be >= 1, got 0"),
    ("dtype", set_key("dtype", "fp8"), "must be one of"),
    ("device", set_key("device", "gpu"), "device must be cpu, cuda, cuda:N or auto"),
    ("groups.prefill.resources_per_rank.gpu", set_key("device", "cuda"), "needs a GPU per rank"),
    ("page_size", set_key("page_size", 12), "power of two"),
    ("worker_host", set_key("worker_host", "10.0.0.1:9000"), "without a port"),
    ("worker_host", set_key("worker_host", ""), "without a port"),
    ("worker_host", set_key("worker_host", 7), "without a port"),
    ("limits.max_num_seqs", set_key("limits.max_num_seqs", 0), "must be >= 1"),
    (
        "limits.max_num_batched_tokens",
        set_key("limits.max_num_batched_tokens", 250),
        "page-aligned",
    ),
    (
        "groups.prefill.limits.max_num_batched_tokens",
        set_key("groups.prefill.limits.max_num_batched_tokens", 100),
        "multiple of page_size (16)",
    ),
    ("limits.num_pages", set_key("limits.kv_memory_bytes", 2**20), "not both"),
    ("limits.kv_memory_bytes", set_key("limits.kv_memory_bytes", "lots"), "such as 512MiB"),
    ("limits.num_pages", set_key("limits.num_pages", 8), "fewer than one request"),
    ("groups.decode.limits.num_pages", set_key("groups.decode.limits.num_pages", 4), "64 tokens"),
    (
        "limits.max_num_batched_tokens",
        set_key("limits.enable_chunked_prefill", False),
        "without chunked prefill",
    ),
    (
        "limits.enable_chunked_prefill",
        set_key("limits.enable_chunked_prefill", "no"),
        "true or false",
    ),
    ("groups.decode.fabric.provider", set_key("groups.decode.fabric.provider", "sockets"), "efa"),
    ("groups.decode.fabric.node", set_key("groups.decode.fabric.node", ""), "non-empty"),
    ("groups", set_key("groups.mixed", {}), "prefill and decode, or mixed alone"),
    ("groups", drop_key("groups.prefill"), "got ['decode']"),
    ("groups", set_key("groups.decode.replicas", 17), "beyond 1:16"),
    (
        "groups.decode.resources_per_rank",
        set_key("groups.decode.resources_per_rank.cpu", 0),
        "nothing",
    ),
    (
        "groups.decode.resources_per_rank.cpu",
        set_key("groups.decode.resources_per_rank.cpu", -1),
        ">= 0",
    ),
    (
        "groups.decode.resources_per_rank.memory",
        set_key("groups.decode.resources_per_rank.memory", "1 parsec"),
        "such as 512MiB",
    ),
    (
        "groups.decode.resources_per_rank.custom.node_a",
        set_key("groups.decode.resources_per_rank.custom", {"node_a": 0}),
        "> 0",
    ),
    (
        "groups.decode.limits.min_step_interval_ms",
        set_key("groups.decode.limits.min_step_interval_ms", -5),
        ">= 0",
    ),
    (
        "limits.min_step_interval_ms",
        set_key("limits.min_step_interval_ms", float("nan")),
        "finite",
    ),
    ("transfer.deadline_seconds", set_key("transfer.deadline_seconds", 0), "must be > 0"),
    ("transfer.coalesce_pages", set_key("transfer.coalesce_pages", 1), "true or false"),
    (
        "transfer.liveness_interval_seconds",
        set_key("transfer.liveness_interval_seconds", -1),
        "must be >= 0",
    ),
    ("router.address", set_key("router.address", "localhost"), "host:port"),
    ("router.address", set_key("router.address", "localhost:70000"), "0-65535"),
    ("router.address", set_key("router.address", 50051), "host:port"),
    ("router.policy", set_key("router.policy", "fastest"), "least_outstanding"),
    ("router.max_queue", set_key("router.max_queue", -1), ">= 0"),
    ("router.default_max_tokens", set_key("router.default_max_tokens", 0), ">= 1"),
    ("router.auth.token", set_key("router.auth.token", ""), "non-empty"),
    ("router.tls.key", set_key("router.tls.cert", "server.pem"), "cert and key go together"),
    ("router.tls.ca", set_key("router.tls.ca", "ca.pem"), "cert and key"),
    ("router", set_key("router", ["127.0.0.1:1"]), "must be a mapping"),
]


@pytest.mark.parametrize(
    ("path", "mutate", "phrase"),
    REJECTIONS,
    ids=[f"{path}-{i}" for i, (path, _, _) in enumerate(REJECTIONS)],
)
def test_rule_rejects_with_field_path(
    path: str, mutate: Callable[[dict[str, Any]], None], phrase: str, smol_dir: Path
) -> None:
    raw = base_dict(smol_dir)
    ClusterConfig.from_dict(copy.deepcopy(raw))  # the unmutated base is valid
    mutate(raw)
    with pytest.raises(ConfigError) as caught:
        ClusterConfig.from_dict(raw)
    assert caught.value.path == path
    assert str(caught.value).startswith(f"{path}: ")
    assert phrase in str(caught.value)


def test_ratio_limit_applies_both_ways(smol_dir: Path) -> None:
    raw = base_dict(smol_dir)
    raw["groups"]["prefill"]["replicas"] = 16
    raw["groups"]["decode"]["replicas"] = 1
    ClusterConfig.from_dict(raw)  # 16:1 is the edge, still allowed
    raw["groups"]["prefill"]["replicas"] = 17
    with pytest.raises(ConfigError, match=r"^groups: prefill:decode replicas 17:1"):
        ClusterConfig.from_dict(raw)


def test_cuda_groups_need_a_gpu_per_rank_and_a_gpu_memory_provider(smol_dir: Path) -> None:
    raw = base_dict(smol_dir)
    raw["device"] = "cuda"
    for role in ("prefill", "decode"):
        raw["groups"][role]["resources_per_rank"] = {"cpu": 1, "gpu": 1}
    with pytest.raises(ConfigError, match=r"^groups\.prefill\.fabric\.provider: tcp;ofi_rxm "):
        ClusterConfig.from_dict(copy.deepcopy(raw))  # checked on the config host: no GPU needed
    for role in ("prefill", "decode"):
        raw["groups"][role]["fabric"] = {"provider": "shm"}
    ClusterConfig.from_dict(copy.deepcopy(raw))  # one node, CUDA IPC
    for role in ("prefill", "decode"):
        raw["groups"][role]["fabric"] = {"provider": "verbs"}
    config = ClusterConfig.from_dict(copy.deepcopy(raw))
    assert config.engine_config("decode").device == "cuda"
    raw["groups"]["decode"]["tp"] = 3  # a GPU per rank, in one bundle (`worker_bundles`)
    assert ClusterConfig.from_dict(raw).group("decode").tp == 3


def test_gpu_ranks_of_a_tp_worker_share_one_bundle() -> None:
    """Ray shows an actor only its own bundle's GPUs: a CUDA TP leader needs all of them."""
    assert worker_bundles({"CPU": 1.0, "GPU": 1.0}, 4) == [{"CPU": 4.0, "GPU": 4.0}]
    assert worker_bundles({"CPU": 1.0, "GPU": 1.0}, 1) == [{"CPU": 1.0, "GPU": 1.0}]
    assert worker_bundles({"CPU": 0.5}, 2) == [{"CPU": 0.5}, {"CPU": 0.5}]


# --- rules that read the model's config.json ------------------------------------------------


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "phrase"),
    [
        (9, 3, 2, "2 must divide the model's 3 KV heads or be a multiple of them"),
        (9, 3, 6, "6 must divide the model's 9 attention heads"),
        (8, 2, 3, "3 must divide the model's 2 KV heads or be a multiple of them"),
    ],
)
def test_tp_must_fit_kv_heads(
    heads: int, kv_heads: int, tp: int, phrase: str, tmp_path: Path
) -> None:
    raw = base_dict(write_model(tmp_path / "m", heads, kv_heads, 4096))
    raw["groups"]["decode"]["tp"] = tp
    with pytest.raises(ConfigError) as caught:
        ClusterConfig.from_dict(raw)
    assert str(caught.value) == f"groups.decode.tp: {phrase}"


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(9, 3, 3), (9, 3, 1), (8, 2, 2), (8, 2, 4)])
def test_tp_sharding_or_replicating_kv_heads_is_accepted(
    heads: int, kv_heads: int, tp: int, tmp_path: Path
) -> None:
    raw = base_dict(write_model(tmp_path / "m", heads, kv_heads, 4096))
    raw["groups"]["prefill"]["tp"] = tp
    assert ClusterConfig.from_dict(raw).group("prefill").tp == tp


def test_max_model_len_beyond_the_model_is_rejected(smol_dir: Path) -> None:
    raw = base_dict(smol_dir)
    raw["limits"].update(max_model_len=10_000, num_pages=1024)
    with pytest.raises(ConfigError, match=r"^limits\.max_model_len: 10000 exceeds .* \(8192\)"):
        ClusterConfig.from_dict(raw)


def test_max_model_len_is_bounded_by_a_sliding_window(tmp_path: Path) -> None:
    """The engine does not implement sliding-window attention, so a checkpoint's window bounds
    max_model_len: given, the config refuses more; left to the model, the window applies."""
    model = write_model(tmp_path / "m", **SMOLLM2_SHAPE)
    config = json.loads((model / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], sliding_window=512)
    (model / "config.json").write_text(json.dumps(config))
    raw = base_dict(model)
    with pytest.raises(ConfigError, match=r"^limits\.max_model_len: 1024 exceeds .*sliding window"):
        ClusterConfig.from_dict(copy.deepcopy(raw))
    del raw["limits"]["max_model_len"]  # the window's 512 applies: 128 pages hold 2048 tokens
    ClusterConfig.from_dict(raw)


def test_kv_pool_must_hold_the_models_own_limit_when_none_is_given(smol_dir: Path) -> None:
    raw = base_dict(smol_dir)
    del raw["limits"]["max_model_len"]  # the model's 8192 applies; 128 pages hold 2048 tokens
    with pytest.raises(ConfigError, match=r"^limits\.num_pages: .*the model's own limit"):
        ClusterConfig.from_dict(raw)


def test_step_budget_must_hold_the_models_own_limit_without_chunked_prefill(
    smol_dir: Path,
) -> None:
    """Else a long prompt could never be scheduled: the engine refuses this at start, the
    config says so first."""
    raw = base_dict(smol_dir)
    del raw["limits"]["max_model_len"]  # the model's 8192 applies
    raw["limits"].update(num_pages=1024, enable_chunked_prefill=False, max_num_batched_tokens=4096)
    with pytest.raises(
        ConfigError, match=r"^limits\.max_num_batched_tokens: 4096 without chunked prefill"
    ):
        ClusterConfig.from_dict(copy.deepcopy(raw))
    raw["limits"]["max_num_batched_tokens"] = 8192
    ClusterConfig.from_dict(raw)


@pytest.mark.parametrize(
    ("grpc", "http"), [("127.0.0.1:9000", "127.0.0.1:9000"), ("0.0.0.0:9000", "127.0.0.1:9000")]
)
def test_router_and_http_on_one_port_are_refused(grpc: str, http: str) -> None:
    with pytest.raises(ConfigError, match=r"^router\.http_address: .* port too"):
        ClusterConfig.from_dict(
            {
                "model": "/nonexistent",
                "groups": {"mixed": None},
                "router": {"address": grpc, "http_address": http},
            }
        )
    ClusterConfig.from_dict(  # port 0: each gets its own free port
        {
            "model": "/nonexistent",
            "groups": {"mixed": None},
            "router": {"address": "127.0.0.1:0", "http_address": "127.0.0.1:0"},
        }
    )


def test_kv_pool_given_in_bytes_must_hold_one_request(smol_dir: Path) -> None:
    """The rule `num_pages` is held to, once the bytes are pages (this SmolLM2-shaped config: 2
    layers, 3 KV heads of 32, float32: 16-token pages of 24,576 bytes; 1024 tokens need 64)."""
    raw = base_dict(smol_dir)
    del raw["limits"]["num_pages"]
    raw["limits"]["kv_memory_bytes"] = 63 * 24_576 + 1
    with pytest.raises(
        ConfigError, match=r"^groups\.prefill\.limits\.kv_memory_bytes: .* 63 pages .* 1024"
    ):
        ClusterConfig.from_dict(copy.deepcopy(raw))
    raw["limits"]["kv_memory_bytes"] = 64 * 24_576
    ClusterConfig.from_dict(raw)


def test_model_dir_without_config_json_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^model: cannot read the checkpoint's config\.json"):
        ClusterConfig.from_dict(base_dict(tmp_path / "empty"))


def test_missing_model_dir_skips_model_rules_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    raw = base_dict(tmp_path / "not-fetched-yet")
    raw["groups"]["decode"]["tp"] = 2  # would be checked against KV heads if the model existed
    with caplog.at_level(logging.WARNING, logger="orchestrator.config.cluster"):
        config = ClusterConfig.from_dict(raw)
    assert config.group("decode").tp == 2
    assert "does not exist on this host" in caplog.text


@pytest.fixture
def raw(tmp_path: Path) -> dict[str, Any]:
    return base_dict(write_model(tmp_path / "smol", **SMOLLM2_SHAPE))


def _gpu_groups(raw: dict[str, Any], device: str, gpu: float, provider: str) -> dict[str, Any]:
    raw["device"] = device
    for role in ("prefill", "decode"):
        raw["groups"][role]["resources_per_rank"] = {"cpu": 1, "gpu": gpu}
        raw["groups"][role]["fabric"] = {"provider": provider}
    return raw


# --- device auto on GPUs --------------------------------------------------------------------------


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


# --- router addresses: port digits --------------------------------------------------------


@pytest.mark.parametrize("port", ["5²", "５００５１", "٥٠٠٥١", "1_000"])
def test_port_of_non_ascii_digits_is_a_config_error(raw: dict[str, Any], port: str) -> None:
    raw["router"]["address"] = f"127.0.0.1:{port}"
    with pytest.raises(ConfigError) as caught:
        ClusterConfig.from_dict(raw)
    assert caught.value.path == "router.address"
    assert "port in 0-65535" in str(caught.value)
    with pytest.raises(ConfigError, match=r"^http_address: "):
        RouterConfig(http_address=f"127.0.0.1:{port}")


# --- router addresses: loopback names on one port ----------------------------------------


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
