"""RoPE (plain and scaled) against HF transformers' rotary embedding and full models."""

from __future__ import annotations

import json
import os
import shutil
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
from workers.engine.errors import UnsupportedCheckpointError
from workers.engine.loader import load_model
from workers.engine.model_config import ModelConfig
from workers.engine.rope import RotaryEmbedding

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROPE_CASES: dict[str, dict[str, Any] | None] = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 64,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
        "truncate": False,
    },
    "legacy-type-key": {"type": "linear", "factor": 2.0},
}


def _hf_config(rope_scaling: dict[str, Any] | None, max_positions: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(  # type: ignore[call-arg]  # rope_* are accepted through **kwargs
        architectures=["LlamaForCausalLM"],
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        intermediate_size=64,
        vocab_size=300,
        rope_theta=50000.0,
        max_position_embeddings=max_positions,
        rope_scaling=dict(rope_scaling) if rope_scaling else None,
    )


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_cos_sin_match_hf_rotary_embedding(case: str) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    max_positions = 256
    # Longer than max_position_embeddings: the dynamic type must rescale.
    num_positions = 400 if case == "dynamic" else 300
    raw = json.loads(_hf_config(ROPE_CASES[case], max_positions).to_json_string())
    ours = RotaryEmbedding(ModelConfig.from_dict(raw))
    hf = LlamaRotaryEmbedding(_hf_config(ROPE_CASES[case], max_positions))

    positions = torch.arange(num_positions)
    expected_cos, expected_sin = hf(torch.zeros(1, dtype=torch.float32), positions[None])
    seq_lens = torch.full((num_positions,), num_positions)
    cos, sin = ours.cos_sin(positions, seq_lens)
    torch.testing.assert_close(cos, expected_cos[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sin, expected_sin[0], atol=1e-5, rtol=1e-5)


def test_unsupported_rope_type_is_rejected() -> None:
    raw = json.loads(_hf_config(None, 256).to_json_string())
    raw["rope_scaling"] = {"rope_type": "su-perfancy", "factor": 2.0}
    raw.pop("rope_parameters", None)
    with pytest.raises(UnsupportedCheckpointError, match="su-perfancy"):
        RotaryEmbedding(ModelConfig.from_dict(raw))


@pytest.mark.parametrize(
    ("case", "changes", "prompt_len"),
    [
        ("yarn", {"rope_scaling": ROPE_CASES["yarn-mscale"]}, 40),
        ("llama3", {"rope_scaling": ROPE_CASES["llama3"]}, 40),
        # max_position_embeddings 32 < prompt: HF's dynamic NTK rescales over the whole prompt.
        ("dynamic", {"rope_scaling": ROPE_CASES["dynamic"], "max_position_embeddings": 32}, 40),
    ],
)
def test_scaled_rope_model_matches_hf(
    tiny_model_dir: Path, tmp_path: Path, case: str, changes: dict[str, Any], prompt_len: int
) -> None:
    model_dir = checkpoint_with_config(tiny_model_dir, tmp_path / case, changes)
    tokens = random_tokens(prompt_len, seed=4)
    model, config = load_model(model_dir)
    assert config.rope_scaling is not None
    [ours] = PagedRunner(model, config).step([(0, tokens)])
    expected = hf_logits(model_dir, tokens)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    # The scaling matters: plain RoPE gives different logits.
    plain_dir = checkpoint_with_config(tiny_model_dir, tmp_path / f"{case}-plain")
    plain, _ = load_model(plain_dir)
    [unscaled] = PagedRunner(plain, config).step([(0, tokens)])
    assert (unscaled - expected).abs().max().item() > 1e-2
    shutil.rmtree(plain_dir)


def _hf_greedy_fresh(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF ``generate`` greedy tokens from a model loaded for this prompt alone.

    HF's dynamic RoPE remembers the longest sequence it has seen across calls; a fresh model is
    the reference for one request.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return list(out[0, len(prompt) :].tolist())


@pytest.mark.parametrize("budget", [16, 2048])
def test_dynamic_rope_generate_matches_hf_under_chunked_prefill(
    tiny_model_dir: Path, tmp_path: Path, budget: int
) -> None:
    # max_position_embeddings 32: the 40-token prompt is scaled from its prefill on, the
    # 24-token one only once decoding takes it past 32. With budget 16 the long prompt runs in
    # chunks, batched with the other request; every chunk must use the whole prompt's base.
    from workers.engine import LLM, SamplingParams

    changes = {"rope_scaling": ROPE_CASES["dynamic"], "max_position_embeddings": 32}
    model_dir = checkpoint_with_config(tiny_model_dir, tmp_path / "dynamic", changes)
    prompts = [random_tokens(40, seed=4), random_tokens(24, seed=5)]
    expected = [_hf_greedy_fresh(model_dir, p, 16) for p in prompts]
    with LLM(
        model_dir, detokenize=False, num_pages=64, max_model_len=128, max_num_batched_tokens=budget
    ) as llm:
        results = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    assert [r.token_ids for r in results] == expected
