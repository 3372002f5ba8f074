"""DeepSeek's latent attention: the absorbed form equals the up-projected one, the cache holds one
latent per token (and its size is what the pool and GetModelInfo report), MTP modules load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.engine.model_helpers import PagedRunner, random_tokens
from workers.engine.attention import create_attention_backend
from workers.engine.cpu_gemm import dense
from workers.engine.errors import UnsupportedCheckpointError
from workers.engine.loader import load_model
from workers.engine.mla import MLAttention
from workers.engine.model_config import ModelConfig
from workers.engine.presets import preset_config


def _up_projected(attn: MLAttention, hidden: torch.Tensor, runner: PagedRunner) -> torch.Tensor:
    """MLA as HF computes it: per-head keys and values up-projected from every cached latent,
    then causal attention of the new tokens (the last ``len(hidden)`` of ``runner``'s cache)."""
    mla = attn.mla
    positions = torch.arange(hidden.shape[0])
    rotary = runner.model.rotary.tables(positions, hidden.dtype)
    q = attn.queries(hidden)
    q = torch.cat(
        (q[..., : mla.qk_nope_head_dim], rotary.rotate(q[..., mla.qk_nope_head_dim :])), -1
    )
    latent = attn.latents(hidden, rotary)[:, 0]
    c_kv, k_pe = latent[:, : mla.kv_lora_rank], latent[:, mla.kv_lora_rank :]
    w_uk, w_uv = attn.absorbed_weights()
    k_nope = torch.einsum("tl,hnl->htn", c_kv, w_uk)
    values = torch.einsum("tl,hvl->htv", c_kv, w_uv)
    keys = torch.cat((k_nope, k_pe[None].expand(attn.num_heads, -1, -1)), -1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys, values, is_causal=True, scale=runner.backend.scale
    )
    attn_out = out.transpose(0, 1).reshape(hidden.shape[0], -1)
    return F.linear(attn_out, dense(attn.o_proj_weight))


def test_absorbed_attention_equals_up_projected(deepseek_model_dir: Path) -> None:
    model, config = load_model(deepseek_model_dir)
    attn = model.layers[0].self_attn
    assert isinstance(attn, MLAttention)
    hidden = torch.randn(21, config.hidden_size, generator=torch.Generator().manual_seed(4))
    runner = PagedRunner(model, config)
    # Prefill 20 tokens, then decode the 21st: the absorbed form reads the cached latents.
    for chunk in (slice(0, 20), slice(20, 21)):
        _, positions, batch = runner.build_batch([(0, [0] * (chunk.stop - chunk.start))])
        rotary = model.rotary.tables(positions, hidden.dtype)
        runner.backend.begin_step(batch)
        absorbed = attn(0, hidden[chunk], rotary, batch, runner.backend)
        expected = _up_projected(attn, hidden[: chunk.stop], runner)[chunk]
        torch.testing.assert_close(absorbed, expected, atol=1e-5, rtol=1e-5)


def test_cache_holds_one_latent_per_token(deepseek_model_dir: Path) -> None:
    model, config = load_model(deepseek_model_dir)
    assert config.mla is not None
    assert (config.num_kv_heads, config.kv_planes, config.head_dim) == (1, 1, 80)
    runner = PagedRunner(model, config)
    tokens = random_tokens(19, seed=6)
    runner.step([(0, tokens)])
    assert runner.kv_cache.shape[2:] == (1, 1, runner.page_size, config.mla.latent_dim)
    # The first layer's latents, recomputed from the embeddings, are what the pages hold.
    attn = model.layers[0].self_attn
    assert isinstance(attn, MLAttention)
    hidden = model.layers[0].input_layernorm(F.embedding(torch.tensor(tokens), model.embed_tokens))
    rotary = model.rotary.tables(torch.arange(len(tokens)), hidden.dtype)
    latents = attn.latents(hidden, rotary)[:, 0]
    pages = runner.pages[0]
    cached = runner.kv_cache[0, pages, 0, 0].reshape(-1, config.head_dim)[: len(tokens)]
    torch.testing.assert_close(cached, latents, atol=1e-6, rtol=0)


def test_kv_bytes_per_token_are_the_latent_size() -> None:
    """DeepSeek-V3 / R1's shape: 61 layers x 576 latent values, ~70 KB a token in bfloat16,
    against ~4-5 MB for its 128 heads as dense K and V."""
    from transformers import DeepseekV3Config

    raw = {**DeepseekV3Config().to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}
    config = ModelConfig.from_dict(raw)
    assert config.kv_page_bytes(1, 2) == 61 * 576 * 2 == 70272
    dense_equivalent = 61 * 128 * (192 + 128) * 2
    assert dense_equivalent / config.kv_page_bytes(1, 2) > 70


def test_softmax_scale_includes_yarn_mscale(deepseek_v2_model_dir: Path) -> None:
    config = ModelConfig.from_dir(deepseek_v2_model_dir)
    assert config.mla is not None
    mscale = 0.1 * 0.707 * torch.log(torch.tensor(4.0)).item() + 1.0
    expected = config.mla.qk_head_dim**-0.5 * mscale**2
    assert config.attention_scale == pytest.approx(expected)
    backend = create_attention_backend("torch", torch.zeros(1, 1, 1, 1, 16, 80), 16, expected)
    assert backend.scale == expected


def test_mtp_modules_are_loaded_and_optional(deepseek_model_dir: Path, tmp_path: Path) -> None:
    config = ModelConfig.from_dir(deepseek_model_dir)
    model, _ = load_model(deepseek_model_dir)
    tensors = load_file(str(deepseek_model_dir / "model.safetensors"))
    mtp_prefix = f"model.layers.{config.num_layers}."
    assert len(model.mtp) == config.num_mtp_layers == 1
    assert torch.equal(dense(model.mtp[0].eh_proj_weight), tensors[f"{mtp_prefix}eh_proj.weight"])
    assert torch.equal(model.mtp[0].embed_tokens, tensors[f"{mtp_prefix}embed_tokens.weight"])

    stripped = tmp_path / "stripped"
    stripped.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (stripped / name).write_bytes((deepseek_model_dir / name).read_bytes())
    main = {k: v for k, v in tensors.items() if not k.startswith(mtp_prefix)}
    save_file(main, str(stripped / "model.safetensors"))
    without, _ = load_model(stripped)
    assert len(without.mtp) == 0

    partial = {**main, f"{mtp_prefix}enorm.weight": tensors[f"{mtp_prefix}enorm.weight"]}
    save_file(partial, str(stripped / "model.safetensors"))
    with pytest.raises(UnsupportedCheckpointError, match="missing tensors"):
        load_model(stripped)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"qk_rope_head_dim": 15}, "even"),
        ({"kv_lora_rank": 0}, "kv_lora_rank"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"topk_method": "best"}, "topk_method"),
        ({"scoring_func": "relu"}, "scoring_func"),
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 5}, "topk_group"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ],
)
def test_unsupported_deepseek_configs_are_refused(change: dict[str, object], message: str) -> None:
    raw = {**preset_config("deepseek-tiny"), **change}
    with pytest.raises(UnsupportedCheckpointError, match=message):
        ModelConfig.from_dict(json.loads(json.dumps(raw)))
