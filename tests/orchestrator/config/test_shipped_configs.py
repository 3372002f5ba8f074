"""The shipped configs load and fit the machines they are for; a minimal one takes the defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.config.cluster import (
    ClusterConfig,
)
from tests.orchestrator.config.config_helpers import (
    CONFIGS,
    REPO,
    SHIPPED,
    SMOLLM2_SHAPE,
    TINY_SHAPE,
    shipped_dict,
    write_model,
)
from workers.engine.config import EngineConfig
from workers.engine.presets import preset_config

# --- shipped configs ------------------------------------------------------------------------


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_loads_with_model_rules(name: str, tmp_path: Path) -> None:
    # A stand-in model of the real head counts makes the model-dependent rules run here (the
    # DeepSeek preset's own config.json: its decoders draft with its MTP module).
    raw = shipped_dict(name)
    if "deepseek" in name:
        model = tmp_path / "model"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(preset_config("deepseek-tiny")))
    else:
        model = write_model(tmp_path / "model", **(TINY_SHAPE if "tp2" in name else SMOLLM2_SHAPE))
    raw["model"] = str(model)
    config = ClusterConfig.from_dict(raw, base_dir=CONFIGS)
    roles = {group.role: (group.replicas, group.tp) for group in config.groups}
    expected = {
        "local-1p3d": {"prefill": (1, 1), "decode": (3, 1)},
        "local-mixed": {"mixed": (4, 1)},
        "local-2p2d-tp2": {"prefill": (2, 2), "decode": (2, 2)},
        "local-1p3d-deepseek": {"prefill": (1, 1), "decode": (3, 1)},
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
    assert config.worker_host is None  # each worker's Ray node IP (loopback on one machine)
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
