"""The cluster config: shipped configs load, every rule rejects with the key's path, overrides."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.config import ClusterConfig, ConfigError, GroupConfig, Resources
from orchestrator.launch import add_serve_arguments, config_from_args
from orchestrator.placement import worker_bundles
from workers.engine.config import EngineConfig

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
SHIPPED = ("local-1p3d", "local-mixed", "local-2p2d-tp2")

# Head counts of the models the shipped configs name (SmolLM2-135M: 9 / 3; preset tiny: 8 / 2).
SMOLLM2_SHAPE = {"heads": 9, "kv_heads": 3, "max_positions": 8192}
TINY_SHAPE = {"heads": 8, "kv_heads": 2, "max_positions": 2048}


def write_model(directory: Path, heads: int, kv_heads: int, max_positions: int) -> Path:
    """A config.json that `ModelConfig.from_dir` accepts; no weights (the config never loads them)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 320,
        "hidden_size": 32 * heads,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_positions,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture
def smol_dir(tmp_path: Path) -> Path:
    return write_model(tmp_path / "smol", **SMOLLM2_SHAPE)


def base_dict(model: Path) -> dict[str, Any]:
    """A valid disaggregated config (1 prefill : 3 decode) to mutate one key at a time."""
    return {
        "model": str(model),
        "dtype": "float32",
        "page_size": 16,
        "limits": {"max_model_len": 1024, "max_num_batched_tokens": 256, "num_pages": 128},
        "groups": {
            "prefill": {"replicas": 1, "tp": 1, "fabric": {"provider": "tcp;ofi_rxm"}},
            "decode": {"replicas": 3, "tp": 1, "resources_per_rank": {"cpu": 0.5}},
        },
        "router": {"address": "127.0.0.1:0"},
    }


def shipped_dict(name: str) -> dict[str, Any]:
    loaded = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    assert isinstance(loaded, dict)
    return loaded


# --- shipped configs ------------------------------------------------------------------------


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_loads_with_model_rules(name: str, tmp_path: Path) -> None:
    # A stand-in model of the real head counts makes the model-dependent rules run here.
    shape = TINY_SHAPE if "tp2" in name else SMOLLM2_SHAPE
    raw = shipped_dict(name)
    raw["model"] = str(write_model(tmp_path / "model", **shape))
    config = ClusterConfig.from_dict(raw, base_dir=CONFIGS)
    roles = {group.role: (group.replicas, group.tp) for group in config.groups}
    expected = {
        "local-1p3d": {"prefill": (1, 1), "decode": (3, 1)},
        "local-mixed": {"mixed": (4, 1)},
        "local-2p2d-tp2": {"prefill": (2, 2), "decode": (2, 2)},
    }[name]
    assert roles == expected
    assert config.is_disaggregated == ("mixed" not in roles)
    for group in config.groups:
        assert isinstance(config.engine_config(group.role), EngineConfig)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_file_loads_and_fits_a_two_core_machine(name: str) -> None:
    # Model rules run only if the model was fetched on this host; the rest always does.
    config = ClusterConfig.from_yaml(CONFIGS / f"{name}.yaml")
    assert config.model.is_absolute()
    assert config.model.parent == (REPO / ".cache" / "models").resolve()
    cpus = sum(g.num_ranks * g.resources_per_rank.cpu for g in config.groups)
    memory = sum(g.num_ranks * (g.resources_per_rank.memory or 0) for g in config.groups)
    assert cpus <= 2
    assert memory <= 8 * 2**30
    assert sum(g.replicas for g in config.groups) == 4  # the mixed baseline matches 1p3d


def test_one_prefill_three_decode_demo_details() -> None:
    config = ClusterConfig.from_yaml(CONFIGS / "local-1p3d.yaml")
    prefill, decode = config.group("prefill"), config.group("decode")
    assert prefill.fabric is not None and prefill.fabric.provider == "tcp;ofi_rxm"
    assert prefill.fabric.node == "127.0.0.1"
    assert config.model.name == "SmolLM2-135M-Instruct"
    # decode overrides only the KV pool and inherits the rest of the top-level limits
    assert (prefill.limits.num_pages, decode.limits.num_pages) == (160, 384)
    assert decode.limits.max_num_batched_tokens == config.limits.max_num_batched_tokens
    assert config.engine_config("decode").num_pages == 384
    assert config.router.port == 50051


def test_minimal_config_takes_defaults(smol_dir: Path) -> None:
    config = ClusterConfig.from_dict({"model": str(smol_dir), "groups": {"mixed": None}})
    (mixed,) = config.groups
    assert (mixed.role, mixed.replicas, mixed.tp, mixed.fabric) == ("mixed", 1, 1, None)
    assert (mixed.nice, mixed.threads) == (0, 1)
    assert (config.dtype, config.page_size) == ("auto", 16)
    assert config.worker_host == "127.0.0.1"  # one machine: workers listen on loopback only
    assert config.router.address == "127.0.0.1:50051"
    assert config.router.policy == "least_outstanding"
    assert not config.router.tls.enabled and config.router.auth.token is None
    assert config.transfer.deadline_seconds > 0
    disaggregated = ClusterConfig.from_dict(
        {"model": str(smol_dir), "groups": {"prefill": {}, "decode": {}}}
    )
    # A prefill/decode group without a fabric section gets the default provider.
    fabric = disaggregated.group("decode").fabric
    assert fabric is not None and fabric.provider == "tcp;ofi_rxm"


# --- every rule rejects with the path of the offending key ----------------------------------


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(raw: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = raw
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value

    return mutate


def _drop(path: str) -> Callable[[dict[str, Any]], None]:
    def mutate(raw: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = raw
        for key in parents:
            node = node[key]
        del node[leaf]

    return mutate


REJECTIONS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    # (expected error path, mutation, a phrase of the message)
    ("model", _drop("model"), "required"),
    ("groups", _drop("groups"), "required"),
    ("groups.decode.tp", _set("groups.decode.tp", 0), "must be >= 1, got 0"),
    ("groups.decode.tp", _set("groups.decode.tp", True), "must be an integer"),
    ("groups.decode.tp", _set("groups.decode.tp", "2"), "must be an integer"),
    ("groups.prefill.replicas", _set("groups.prefill.replicas", 0), "must be >= 1"),
    ("groups.prefill.nice", _set("groups.prefill.nice", -1), "must be >= 0, got -1"),
    ("groups.prefill.nice", _set("groups.prefill.nice", 20), "must be <= 19, got 20"),
    ("groups.decode.threads", _set("groups.decode.threads", 0), "must be >= 1, got 0"),
    ("dtype", _set("dtype", "fp8"), "must be one of"),
    ("device", _set("device", "gpu"), "device must be cpu, cuda, cuda:N or auto"),
    ("groups.prefill.resources_per_rank.gpu", _set("device", "cuda"), "needs a GPU per rank"),
    ("page_size", _set("page_size", 12), "power of two"),
    ("worker_host", _set("worker_host", "10.0.0.1:9000"), "without a port"),
    ("worker_host", _set("worker_host", ""), "without a port"),
    ("worker_host", _set("worker_host", None), "without a port"),
    ("limits.max_num_seqs", _set("limits.max_num_seqs", 0), "must be >= 1"),
    ("limits.max_num_batched_tokens", _set("limits.max_num_batched_tokens", 250), "page-aligned"),
    (
        "groups.prefill.limits.max_num_batched_tokens",
        _set("groups.prefill.limits.max_num_batched_tokens", 100),
        "multiple of page_size (16)",
    ),
    ("limits.num_pages", _set("limits.kv_memory_bytes", 2**20), "not both"),
    ("limits.kv_memory_bytes", _set("limits.kv_memory_bytes", "lots"), "such as 512MiB"),
    ("limits.num_pages", _set("limits.num_pages", 8), "fewer than one request"),
    ("groups.decode.limits.num_pages", _set("groups.decode.limits.num_pages", 4), "64 tokens"),
    (
        "limits.max_num_batched_tokens",
        _set("limits.enable_chunked_prefill", False),
        "without chunked prefill",
    ),
    ("limits.enable_chunked_prefill", _set("limits.enable_chunked_prefill", "no"), "true or false"),
    ("groups.decode.fabric.provider", _set("groups.decode.fabric.provider", "sockets"), "efa"),
    ("groups.decode.fabric.node", _set("groups.decode.fabric.node", ""), "non-empty"),
    ("groups", _set("groups.mixed", {}), "prefill and decode, or mixed alone"),
    ("groups", _drop("groups.prefill"), "got ['decode']"),
    ("groups", _set("groups.decode.replicas", 17), "beyond 1:16"),
    (
        "groups.decode.resources_per_rank",
        _set("groups.decode.resources_per_rank.cpu", 0),
        "nothing",
    ),
    (
        "groups.decode.resources_per_rank.cpu",
        _set("groups.decode.resources_per_rank.cpu", -1),
        ">= 0",
    ),
    (
        "groups.decode.resources_per_rank.memory",
        _set("groups.decode.resources_per_rank.memory", "1 parsec"),
        "such as 512MiB",
    ),
    (
        "groups.decode.resources_per_rank.custom.node_a",
        _set("groups.decode.resources_per_rank.custom", {"node_a": 0}),
        "> 0",
    ),
    ("transfer.deadline_seconds", _set("transfer.deadline_seconds", 0), "must be > 0"),
    ("transfer.coalesce_pages", _set("transfer.coalesce_pages", 1), "true or false"),
    (
        "transfer.liveness_interval_seconds",
        _set("transfer.liveness_interval_seconds", -1),
        "must be >= 0",
    ),
    ("router.address", _set("router.address", "localhost"), "host:port"),
    ("router.address", _set("router.address", "localhost:70000"), "0-65535"),
    ("router.address", _set("router.address", 50051), "host:port"),
    ("router.policy", _set("router.policy", "fastest"), "least_outstanding"),
    ("router.max_queue", _set("router.max_queue", -1), ">= 0"),
    ("router.default_max_tokens", _set("router.default_max_tokens", 0), ">= 1"),
    ("router.auth.token", _set("router.auth.token", ""), "non-empty"),
    ("router.tls.key", _set("router.tls.cert", "server.pem"), "cert and key go together"),
    ("router.tls.ca", _set("router.tls.ca", "ca.pem"), "cert and key"),
    ("router", _set("router", ["127.0.0.1:1"]), "must be a mapping"),
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
    with caplog.at_level(logging.WARNING, logger="orchestrator.config"):
        config = ClusterConfig.from_dict(raw)
    assert config.group("decode").tp == 2
    assert "does not exist on this host" in caplog.text


# --- unknown keys and YAML hygiene ----------------------------------------------------------


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_set("modle", "x"), "modle: unknown key; did you mean 'model'?"),
        (_set("groups.decoder", {}), "groups.decoder: unknown key; did you mean 'decode'?"),
        (_set("groups.decode.tpp", 2), "groups.decode.tpp: unknown key; did you mean 'tp'?"),
        (_set("groups.decode.role", "mixed"), "groups.decode.role: unknown key"),
        (_set("groups.decode.limits.max_model_len", 64), "groups.decode.limits.max_model_len:"),
        (_set("groups.decode.fabric.nic", "eth0"), "groups.decode.fabric.nic: unknown key"),
        (_set("limits.max_tokens", 64), "limits.max_tokens: unknown key"),
        (_set("router.tls.crt", "a.pem"), "router.tls.crt: unknown key; did you mean 'cert'?"),
        (_set("router.auth.password", "x"), "router.auth.password: unknown key"),
        (_set("transfer.timeout", 3), "transfer.timeout: unknown key"),
    ],
)
def test_unknown_keys_are_rejected(
    mutate: Callable[[dict[str, Any]], None], message: str, smol_dir: Path
) -> None:
    raw = base_dict(smol_dir)
    mutate(raw)
    with pytest.raises(ConfigError) as caught:
        ClusterConfig.from_dict(raw)
    assert str(caught.value).startswith(message)


def test_yaml_errors_name_the_file(tmp_path: Path, smol_dir: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(f"model: {smol_dir}\ngroups:\n  decode: {{tp: 1}}\n  decode: {{tp: 2}}\n")
    with pytest.raises(
        ConfigError, match=r"cluster\.yaml: not valid YAML: .*duplicate key 'decode'"
    ):
        ClusterConfig.from_yaml(path)
    path.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match=r"cluster\.yaml: not valid YAML"):
        ClusterConfig.from_yaml(path)
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match=r"cluster\.yaml: must be a mapping"):
        ClusterConfig.from_yaml(path)
    path.write_text(f"model: {smol_dir}\ngroups: {{mixed: {{tp: 0}}}}\n")
    with pytest.raises(ConfigError, match=r"^.*cluster\.yaml: groups\.mixed\.tp: must be >= 1"):
        ClusterConfig.from_yaml(path)
    with pytest.raises(ConfigError, match=r"absent\.yaml: cannot read it"):
        ClusterConfig.from_yaml(tmp_path / "absent.yaml")


def test_yaml_merge_keys_may_be_overridden(tmp_path: Path, smol_dir: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(
        f"model: {smol_dir}\n"
        "worker: &worker {tp: 1, resources_per_rank: {cpu: 0.5}}\n"
        "groups:\n"
        "  prefill: {<<: *worker}\n"
        "  decode: {<<: *worker, replicas: 3}\n"
    )
    # The anchor's holder is an unknown top-level key: anchors must live inside known sections.
    with pytest.raises(ConfigError, match="worker: unknown key"):
        ClusterConfig.from_yaml(path)
    path.write_text(
        f"model: {smol_dir}\n"
        "groups:\n"
        "  prefill: &worker {tp: 1, replicas: 1, resources_per_rank: {cpu: 0.5}}\n"
        "  decode: {<<: *worker, replicas: 3}\n"
    )
    config = ClusterConfig.from_yaml(path)
    assert (config.group("prefill").replicas, config.group("decode").replicas) == (1, 3)


# --- parsing details ------------------------------------------------------------------------


def test_relative_paths_resolve_against_the_config_file(tmp_path: Path) -> None:
    write_model(tmp_path / "models" / "m", **SMOLLM2_SHAPE)
    (tmp_path / "configs").mkdir()
    path = tmp_path / "configs" / "c.yaml"
    path.write_text(
        "model: ../models/m\ngroups: {mixed: {}}\nrouter: {tls: {cert: s.pem, key: s.key}}\n"
    )
    config = ClusterConfig.from_yaml(path)
    assert config.model == (tmp_path / "models" / "m").resolve()
    assert config.router.tls.cert == (tmp_path / "configs" / "s.pem").resolve()
    assert config.router.tls.enabled


def test_byte_sizes_and_provider_aliases(smol_dir: Path) -> None:
    raw = base_dict(smol_dir)
    # 1.5 MiB: 64 pages of 24,576 bytes, 1024 tokens: one request of max_model_len fits.
    raw["limits"] = {
        "max_num_batched_tokens": 256,
        "max_model_len": 128,
        "kv_memory_bytes": "1.5 MiB",
    }
    raw["groups"]["decode"]["resources_per_rank"] = {"cpu": 1, "gpu": 0, "memory": "2GB"}
    raw["groups"]["decode"]["fabric"] = {"provider": "tcp", "node": "127.0.0.1"}
    raw["groups"]["prefill"]["limits"] = {"num_pages": 600}
    raw["groups"]["prefill"]["resources_per_rank"] = {"cpu": 2, "custom": {"b": 1, "a": 2}}
    config = ClusterConfig.from_dict(raw)
    decode, prefill = config.group("decode"), config.group("prefill")
    assert decode.limits.kv_memory_bytes == 3 * 2**19
    assert decode.resources_per_rank.memory == 2 * 10**9
    assert decode.fabric is not None and decode.fabric.provider == "tcp;ofi_rxm"
    # The group's num_pages replaces the top-level kv_memory_bytes instead of clashing with it.
    assert (prefill.limits.num_pages, prefill.limits.kv_memory_bytes) == (600, None)
    assert prefill.resources_per_rank.custom == (("a", 2), ("b", 1))
    assert prefill.resources_per_rank.bundle() == {"CPU": 2, "a": 2, "b": 1}
    assert decode.resources_per_rank.bundle() == {"CPU": 1, "memory": 2 * 10**9}


def test_direct_construction_validates_too() -> None:
    with pytest.raises(ConfigError, match=r"^tp: must be >= 1, got 0"):
        GroupConfig(role="mixed", tp=0)
    with pytest.raises(ConfigError, match=r"^fabric: required for a decode group"):
        GroupConfig(role="decode")
    with pytest.raises(ConfigError, match="asks for nothing"):
        Resources(cpu=0)


# --- overrides and immutability -------------------------------------------------------------


def test_overrides_return_a_new_validated_config(
    tmp_path: Path, smol_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = ClusterConfig.from_dict(base_dict(smol_dir))
    other = write_model(tmp_path / "other", **SMOLLM2_SHAPE)
    monkeypatch.chdir(tmp_path)
    changed = config.with_overrides(model="other", address="0.0.0.0:6000")
    assert changed.model == other.resolve()  # relative --model: against the working directory
    assert (changed.router.host, changed.router.port) == ("0.0.0.0", 6000)
    assert (config.model, config.router.address) == (smol_dir.resolve(), "127.0.0.1:0")
    assert config.with_overrides() is config
    assert changed.with_overrides(address="[::1]:7000").router.host == "::1"
    with pytest.raises(ConfigError, match=r"^router\.address: must be 'host:port'"):
        config.with_overrides(address="nowhere")


@pytest.mark.parametrize("word", ["none", "None", "NULL", "off", " none "])
def test_http_address_override_none_serves_no_http(smol_dir: Path, word: str) -> None:
    config = ClusterConfig.from_dict(base_dict(smol_dir))
    assert config.router.http_address is not None
    assert config.with_overrides(http_address=word).router.http_address is None
    changed = config.with_overrides(http_address="0.0.0.0:8080")
    assert changed.router.http_host_port == ("0.0.0.0", 8080)
    assert config.with_overrides(http_address=None).router.http_address == (
        config.router.http_address
    )


def test_command_line_http_address_none(tmp_path: Path, smol_dir: Path) -> None:
    """``--http-address none`` (as `pdserve serve` and `orchestrator.launch` parse it)."""
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(base_dict(smol_dir)))
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args([str(path), "--http-address", "None"])
    assert config_from_args(args).router.http_address is None
    args = parser.parse_args([str(path), "--http-address", "127.0.0.1:0"])
    assert config_from_args(args).router.http_address == "127.0.0.1:0"
    args = parser.parse_args([str(path), "--http-address", "nowhere"])
    with pytest.raises(ConfigError, match=r"^router\.http_address: must be 'host:port'"):
        config_from_args(args)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "fd00::5", "worker-0.svc"])
def test_worker_host_takes_hosts_and_wildcards(smol_dir: Path, host: str) -> None:
    raw = base_dict(smol_dir)
    raw["worker_host"] = host
    assert ClusterConfig.from_dict(raw).worker_host == host


def test_auth_token_may_come_from_a_file(tmp_path: Path, smol_dir: Path) -> None:
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "token").write_text("s3cret\n")  # as a mounted Secret holds it
    raw = base_dict(smol_dir)
    raw["router"]["auth"] = {"token_file": "secrets/token"}  # relative to the YAML file
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(raw))
    config = ClusterConfig.from_yaml(path)
    assert config.router.auth.token == "s3cret"
    assert "s3cret" not in repr(config)
    raw["router"]["auth"] = {"token_file": None}
    assert ClusterConfig.from_dict(raw).router.auth.token is None


@pytest.mark.parametrize(
    ("auth", "phrase"),
    [
        ({"token_file": "absent"}, "cannot read"),
        ({"token_file": "empty"}, "is empty"),
        ({"token_file": "empty", "token": "x"}, "not both"),
    ],
)
def test_bad_token_file_is_rejected(
    tmp_path: Path, smol_dir: Path, auth: dict[str, str], phrase: str
) -> None:
    (tmp_path / "empty").write_text("\n")
    raw = base_dict(smol_dir)
    raw["router"]["auth"] = auth
    with pytest.raises(ConfigError, match=rf"^router\.auth\.token_file: .*{phrase}"):
        ClusterConfig.from_dict(raw, base_dir=tmp_path)


def test_model_override_reruns_the_model_rules(tmp_path: Path, smol_dir: Path) -> None:
    tiny = write_model(tmp_path / "tiny", **TINY_SHAPE)
    raw = base_dict(tiny)
    raw["groups"]["decode"]["tp"] = 2
    config = ClusterConfig.from_dict(raw)
    with pytest.raises(ConfigError, match=r"^groups\.decode\.tp: 2 must divide the model's 3 KV"):
        config.with_overrides(model=smol_dir)


def test_config_is_frozen_hashable_and_picklable(smol_dir: Path) -> None:
    config = ClusterConfig.from_dict(base_dict(smol_dir))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.page_size = 32  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.group("decode").tp = 2  # type: ignore[misc]
    assert hash(config) == hash(ClusterConfig.from_dict(base_dict(smol_dir)))
    # The control plane ships the config to Ray actors.
    assert pickle.loads(pickle.dumps(config)) == config


def test_engine_config_per_group(smol_dir: Path) -> None:
    raw = base_dict(smol_dir)
    raw["groups"]["decode"]["limits"] = {"max_num_seqs": 128, "num_pages": 256}
    config = ClusterConfig.from_dict(raw)
    decode = config.engine_config("decode")
    prefill = config.engine_config("prefill")
    assert (decode.role, decode.max_num_seqs, decode.num_pages) == ("decode", 128, 256)
    assert (prefill.role, prefill.max_num_seqs, prefill.num_pages) == ("prefill", 64, 128)
    assert decode.max_model_len == prefill.max_model_len == 1024
    assert decode.dtype == "float32" and decode.page_size == 16
    with pytest.raises(KeyError, match="no 'mixed' group"):
        config.engine_config("mixed")


def test_auth_token_stays_out_of_repr(smol_dir: Path) -> None:
    raw = base_dict(smol_dir)
    raw["router"]["auth"] = {"token": "s3cret"}
    config = ClusterConfig.from_dict(raw)
    assert config.router.auth.token == "s3cret"
    assert "s3cret" not in repr(config)
