"""Mixture-of-experts: every routing method picks HF's experts with HF's weights, and experts
split over tensor-parallel ranks sum to the whole layer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from workers.engine.loader import load_model
from workers.engine.model_config import ModelConfig
from workers.engine.moe import MoE, Router
from workers.engine.parallel import shard_spec
from workers.engine.presets import preset_config

HIDDEN = 64


def _hf_router(preset: str, overrides: dict[str, Any]) -> tuple[torch.nn.Module, ModelConfig]:
    from transformers import AutoConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    raw = {**preset_config(preset), "hidden_size": HIDDEN, **overrides}
    model_type = raw.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **raw)
    classes = {
        "deepseek_v3": DeepseekV3TopkRouter,
        "deepseek_v2": DeepseekV2TopkRouter,
        "qwen3_moe": Qwen3MoeTopKRouter,
    }
    return classes[model_type](hf_config), ModelConfig.from_dict(raw)


@pytest.mark.parametrize(
    ("preset", "overrides"),
    [
        ("deepseek-tiny", {}),  # sigmoid, noaux_tc over groups, normalised, scaled by 2.5
        ("deepseek-v2-tiny", {}),  # softmax, group_limited_greedy
        ("deepseek-v2-tiny", {"topk_method": "greedy"}),
        ("qwen3-moe-tiny", {}),  # softmax, greedy, normalised
        ("qwen3-moe-tiny", {"norm_topk_prob": False}),
    ],
    ids=["v3-noaux_tc", "v2-group_limited", "v2-greedy", "qwen3-moe", "qwen3-moe-unnormalised"],
)
def test_router_matches_hf(preset: str, overrides: dict[str, Any]) -> None:
    hf, config = _hf_router(preset, overrides)
    assert config.moe is not None
    ours = Router(HIDDEN, config.moe)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(ours.weight.shape, generator=generator))
        hf.weight.copy_(ours.weight)
        if ours.e_score_correction_bias is not None:
            ours.e_score_correction_bias.copy_(0.3 * torch.randn(config.moe.num_experts))
            hf.e_score_correction_bias.copy_(ours.e_score_correction_bias)
        hidden = torch.randn(200, HIDDEN, generator=generator)
        weights, ids = ours(hidden)
        _, hf_weights, hf_ids = hf(hidden)
    # Same experts (top-k order is unspecified), same weight for each.
    ours_sorted, order = ids.sort(dim=-1)
    hf_sorted, hf_order = hf_ids.sort(dim=-1)
    assert torch.equal(ours_sorted, hf_sorted)
    torch.testing.assert_close(
        weights.gather(1, order), hf_weights.float().gather(1, hf_order), atol=1e-6, rtol=1e-6
    )


@pytest.mark.parametrize("fixture", ["deepseek_model_dir", "qwen3_moe_model_dir"])
@pytest.mark.parametrize("tp", [2, 4])
def test_experts_split_over_ranks_sum_to_the_layer(
    fixture: str, tp: int, request: pytest.FixtureRequest
) -> None:
    """In-process: each rank's MoE (its routed experts and its columns of the shared ones, no
    all-reduce) adds up to the full layer; every expert is held by exactly one rank."""
    model_dir = Path(request.getfixturevalue(fixture))
    full, config = load_model(model_dir)
    assert config.moe is not None
    layer = config.moe.moe_layers.index(True)
    whole = full.layers[layer].mlp
    assert isinstance(whole, MoE)
    x = torch.randn(40, config.hidden_size, generator=torch.Generator().manual_seed(2))
    expected = whole(x)
    total = torch.zeros_like(expected)
    held: list[int] = []
    for rank in range(tp):
        shard, _ = load_model(model_dir, shard=shard_spec(config, tp, rank))
        part = shard.layers[layer].mlp
        assert isinstance(part, MoE)
        held += range(part.expert_start, part.expert_start + part.num_local_experts)
        index = part.expert_start
        assert torch.equal(part.experts_down[0], whole.experts_down[index])
        total += part(x)
    assert sorted(held) == list(range(config.moe.num_experts))
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=1e-5)


def test_moe_layers_follow_the_config() -> None:
    deepseek = ModelConfig.from_dict(preset_config("deepseek-tiny"))
    qwen = ModelConfig.from_dict({**preset_config("qwen3-moe-tiny"), "decoder_sparse_step": 2})
    assert deepseek.moe is not None and qwen.moe is not None
    assert deepseek.moe.moe_layers == (False, True, True)  # first_k_dense_replace 1
    # mlp_only_layers [0]; with decoder_sparse_step 2 only layers 1, 3, ... are sparse.
    assert qwen.moe.moe_layers == (False, True, False)


def test_tensor_parallel_needs_divisible_experts() -> None:
    from workers.engine.errors import TensorParallelConfigError

    config = ModelConfig.from_dict(preset_config("deepseek-tiny"))
    with pytest.raises(TensorParallelConfigError, match="routed experts"):
        shard_spec(config, 3, 0)
