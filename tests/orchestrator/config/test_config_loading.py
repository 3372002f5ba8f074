"""Loading the cluster config: unknown keys, YAML hygiene, relative paths, byte sizes, direct
construction."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config.cluster import (
    ClusterConfig,
    ConfigError,
    GroupConfig,
    Resources,
)
from tests.orchestrator.config.config_helpers import (
    SMOLLM2_SHAPE,
    base_dict,
    set_key,
    write_model,
)

# --- unknown keys and YAML hygiene ----------------------------------------------------------


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (set_key("modle", "x"), "modle: unknown key; did you mean 'model'?"),
        (set_key("groups.decoder", {}), "groups.decoder: unknown key; did you mean 'decode'?"),
        (set_key("groups.decode.tpp", 2), "groups.decode.tpp: unknown key; did you mean 'tp'?"),
        (set_key("groups.decode.role", "mixed"), "groups.decode.role: unknown key"),
        (set_key("groups.decode.limits.max_model_len", 64), "groups.decode.limits.max_model_len:"),
        (set_key("groups.decode.fabric.nic", "eth0"), "groups.decode.fabric.nic: unknown key"),
        (set_key("limits.max_tokens", 64), "limits.max_tokens: unknown key"),
        (set_key("router.tls.crt", "a.pem"), "router.tls.crt: unknown key; did you mean 'cert'?"),
        (set_key("router.auth.password", "x"), "router.auth.password: unknown key"),
        (set_key("transfer.timeout", 3), "transfer.timeout: unknown key"),
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


def test_a_step_interval_reaches_the_engines_of_its_groups(smol_dir: Path) -> None:
    raw = base_dict(smol_dir)
    raw["limits"] = {"min_step_interval_ms": 5}
    raw["groups"]["decode"]["limits"] = {"min_step_interval_ms": 25}
    config = ClusterConfig.from_dict(raw)
    assert config.engine_config("decode").min_step_interval_s == 0.025
    # Prefill steps always carry prompt work, which pacing never delays (`StepLoop`).
    assert config.engine_config("prefill").min_step_interval_s == 0.005


def test_direct_construction_validates_too() -> None:
    with pytest.raises(ConfigError, match=r"^tp: must be >= 1, got 0"):
        GroupConfig(role="mixed", tp=0)
    with pytest.raises(ConfigError, match=r"^fabric: required for a decode group"):
        GroupConfig(role="decode")
    with pytest.raises(ConfigError, match="asks for nothing"):
        Resources(cpu=0)
