"""Configs to test the loader with: a stand-in model directory of given head counts, a valid
disaggregated config to mutate one key at a time, the shipped configs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "configs"
SHIPPED = ("local-1p3d", "local-mixed", "local-2p2d-tp2", "local-1p3d-deepseek")

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


def set_key(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(raw: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = raw
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value

    return mutate


def drop_key(path: str) -> Callable[[dict[str, Any]], None]:
    def mutate(raw: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = raw
        for key in parents:
            node = node[key]
        del node[leaf]

    return mutate
