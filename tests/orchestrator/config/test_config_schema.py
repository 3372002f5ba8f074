"""The JSON schema of the cluster config file, made from the models: it takes what the loader
takes (the shipped configs) and refuses, key by key, what the loader refuses."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from orchestrator.config.cluster import GROUP_LIMIT_KEYS, ClusterConfig, ConfigError
from orchestrator.config.schema import cluster_config_schema
from tests.orchestrator.config.config_helpers import (
    SHIPPED,
    base_dict,
    drop_key,
    set_key,
    shipped_dict,
)


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    schema = cluster_config_schema()
    jsonschema.Draft7Validator.check_schema(schema)  # the Helm chart's draft
    return schema


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_pass_the_schema(schema: dict[str, Any], name: str) -> None:
    jsonschema.validate(shipped_dict(name), schema)


def test_a_loadable_config_passes_the_schema(schema: dict[str, Any], smol_dir: Path) -> None:
    raw = base_dict(smol_dir)
    raw["limits"] = {"max_model_len": 1024, "kv_memory_bytes": "64MiB"}
    raw["groups"]["decode"]["limits"] = {"num_pages": 256}
    raw["groups"]["prefill"]["resources_per_rank"] = {"cpu": 1, "custom": {"node_a": 1}}
    raw["router"]["auth"] = {"token_file": "token"}
    jsonschema.validate(raw, schema)


SCHEMA_REFUSALS: list[Callable[[dict[str, Any]], None]] = [
    drop_key("model"),
    drop_key("groups"),
    set_key("modle", "x"),
    set_key("groups.decoder", {}),
    set_key("groups.decode.role", "decode"),
    set_key("groups.decode.tp", 0),
    set_key("groups.decode.tp", True),
    set_key("groups.decode.limits.max_model_len", 64),
    set_key("groups.decode.fabric.provider", "sockets"),
    set_key("groups.decode.resources_per_rank.custom", {"node_a": 0}),
    set_key("dtype", "fp8"),
    set_key("device", "gpu"),
    set_key("page_size", 12),
    set_key("limits.kv_memory_bytes", "lots"),
    set_key("limits.enable_chunked_prefill", "no"),
    set_key("transfer.deadline_seconds", 0),
    set_key("router.policy", "fastest"),
    set_key("router.max_request_bytes", 100),
    set_key("router.auth.token", ""),
    set_key("router.tls.crt", "a.pem"),
]


@pytest.mark.parametrize("mutate", SCHEMA_REFUSALS)
def test_schema_refuses_what_the_loader_refuses(
    schema: dict[str, Any], mutate: Callable[[dict[str, Any]], None], smol_dir: Path
) -> None:
    raw = base_dict(smol_dir)
    jsonschema.validate(copy.deepcopy(raw), schema)
    mutate(raw)
    with pytest.raises(ConfigError):
        ClusterConfig.from_dict(copy.deepcopy(raw))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(raw, schema)


def test_groups_are_a_mapping_of_role_to_group(schema: dict[str, Any]) -> None:
    groups = schema["properties"]["groups"]
    assert set(groups["properties"]) == {"prefill", "decode", "mixed"}
    decode = groups["properties"]["decode"]
    assert "role" not in decode["properties"]
    assert set(decode["properties"]["limits"]["properties"]) == set(GROUP_LIMIT_KEYS)
    assert set(schema["required"]) == {"model", "groups"}
