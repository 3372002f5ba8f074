"""config.json read as HF transformers reads it: where RoPE's theta and pretraining length come
from when a config has them twice, each family's defaults for missing keys, Qwen2's fixed
biases, and Mistral's default sliding window."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.model_helpers import (
    PagedRunner,
    checkpoint_with_config,
    hf_logits,
    random_tokens,
)
from workers.engine.config import EngineConfig
from workers.engine.engine_core import EngineCore
from workers.engine.errors import UnsupportedCheckpointError
from workers.engine.loader import load_model
from workers.engine.model_config import ModelConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ATOL = 1e-4
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
MISTRAL = {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}


def assert_logits_match_hf(model_dir: Path, num_tokens: int = 40) -> None:
    tokens = random_tokens(num_tokens, seed=4)
    model, config = load_model(model_dir)
    [ours] = PagedRunner(model, config).step([(0, tokens)])
    torch.testing.assert_close(ours, hf_logits(model_dir, tokens), atol=ATOL, rtol=0)


# Each config carries RoPE's theta or pretraining length twice; HF takes the RoPE dict's theta
# and the top-level original_max_position_embeddings.
TWICE_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-theta-in-rope-parameters": (
        "qwen3",  # top-level rope_theta 1e6
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    ),
    "llama3-theta-in-rope-parameters": (
        "tiny",  # top-level rope_theta 1e4
        {"rope_parameters": {**LLAMA3, "rope_theta": 500000.0}},
    ),
    "linear-theta-in-rope-scaling": (
        "tiny",
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}},
    ),
    "yarn-top-level-original-max": (
        "tiny",
        {"rope_scaling": YARN, "original_max_position_embeddings": 32},
    ),
    "llama3-top-level-original-max": (
        "tiny",
        {"rope_scaling": LLAMA3, "original_max_position_embeddings": 32},
    ),
}


@pytest.mark.parametrize("case", list(TWICE_CASES))
def test_rope_values_given_twice_are_read_as_hf_reads_them(
    tiny_model_dir: Path, qwen3_model_dir: Path, tmp_path: Path, case: str
) -> None:
    preset, changes = TWICE_CASES[case]
    src = qwen3_model_dir if preset == "qwen3" else tiny_model_dir
    assert_logits_match_hf(checkpoint_with_config(src, tmp_path / case, changes))


def test_qwen2_keeps_its_biases_whatever_attention_bias_says(
    qwen2_model_dir: Path, tmp_path: Path
) -> None:
    # transformers' Qwen2 attention always has q/k/v biases and ignores the key.
    model_dir = checkpoint_with_config(
        qwen2_model_dir, tmp_path / "qwen2", {"attention_bias": False}
    )
    config = ModelConfig.from_dir(model_dir)
    assert (config.attention_bias, config.o_proj_bias) == (True, False)
    assert_logits_match_hf(model_dir)


# Configs that leave keys out, and the HF config class whose defaults fill them.
DEFAULT_CASES: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "llama": ("tiny", {}, ("max_position_embeddings",)),
    "mistral": ("tiny", MISTRAL, ("max_position_embeddings", "sliding_window")),
    "qwen2": ("qwen2", {}, ("max_position_embeddings", "sliding_window")),
    "qwen3": ("qwen3", {}, ("max_position_embeddings", "sliding_window")),
    # Qwen's window is off unless use_sliding_window turns it on.
    "qwen2-window-without-switch": ("qwen2", {"sliding_window": 64}, ("use_sliding_window",)),
    "qwen3-switch-without-window": ("qwen3", {"use_sliding_window": True}, ("sliding_window",)),
}


@pytest.mark.parametrize("case", list(DEFAULT_CASES))
def test_missing_keys_take_the_hf_family_default(
    tiny_model_dir: Path,
    qwen2_model_dir: Path,
    qwen3_model_dir: Path,
    tmp_path: Path,
    case: str,
) -> None:
    from transformers import AutoConfig

    preset, changes, drop = DEFAULT_CASES[case]
    src = {"tiny": tiny_model_dir, "qwen2": qwen2_model_dir, "qwen3": qwen3_model_dir}[preset]
    model_dir = checkpoint_with_config(src, tmp_path / case, changes, drop)
    ours = ModelConfig.from_dir(model_dir)
    hf = AutoConfig.from_pretrained(model_dir)
    assert ours.max_position_embeddings == hf.max_position_embeddings
    assert ours.sliding_window == getattr(hf, "sliding_window", None)


def test_mistral_without_a_window_key_is_bounded_by_hf_default_window(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # MistralConfig's 4096-token window applies when the key is absent; full attention past it
    # would not be HF's model.
    drop = ("sliding_window", "max_position_embeddings")  # the latter defaults to 131072
    model_dir = checkpoint_with_config(tiny_model_dir, tmp_path / "mistral", MISTRAL, drop)
    assert ModelConfig.from_dir(model_dir).max_len == 4096
    assert_logits_match_hf(model_dir)
    with pytest.raises(UnsupportedCheckpointError, match="sliding window"):
        EngineCore(model_dir, EngineConfig(num_pages=16, max_model_len=4097))
