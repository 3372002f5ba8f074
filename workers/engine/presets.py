"""Random-initialised HF-format checkpoints for tests and benchmarks (``pdserve make-model``).

Each preset writes ``config.json``, ``model.safetensors`` (float32, deterministic from the seed),
a byte-level ``tokenizer.json`` (byte b = token id b, then ``<s>``, ``</s>``, ``<pad>``),
``tokenizer_config.json`` with a small chat template, and ``generation_config.json``. HF
transformers loads the result offline with ``AutoModelForCausalLM`` / ``AutoTokenizer``.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from workers.engine.model_config import ModelConfig
from workers.engine.tokenizer import DEFAULT_CHAT_TEMPLATE, bytes_to_unicode
from workers.engine.weight_map import expected_tensor_names

logger = logging.getLogger(__name__)

NUM_BYTE_TOKENS = 256
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<s>", "</s>", "<pad>"
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
# Larger than the 259 tokenizer entries on purpose: real checkpoints pad their vocabulary too.
PRESET_VOCAB_SIZE = 320


_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
}
_QWEN3: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
}
_QWEN2: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
}


_DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "rope_interleave": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "moe_layer_freq": 1,
}
_QWEN3_MOE: dict[str, Any] = {
    **_QWEN3,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "tie_word_embeddings": False,
    "decoder_sparse_step": 1,
}


# Latent and expert sizes of the DeepSeek presets (the latent: 64 + 16 = 80 values a token).
_DEEPSEEK_TINY_DIMS: dict[str, Any] = {
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "head_dim": 16,  # transformers' rotary embedding reads the RoPE width from head_dim
    "moe_intermediate_size": 128,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
}


def _shape(hidden: int, layers: int, heads: int, kv_heads: int, inter: int) -> dict[str, Any]:
    return {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "intermediate_size": inter,
    }


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {**_LLAMA, **_shape(256, 4, 8, 2, 688), "max_position_embeddings": 2048},
    "small": {**_LLAMA, **_shape(512, 6, 8, 4, 1376), "max_position_embeddings": 4096},
    # head_dim 64 != hidden / heads (32), like real Qwen3 checkpoints.
    "qwen3-tiny": {
        **_QWEN3,
        **_shape(256, 4, 8, 2, 512),
        "head_dim": 64,
        "max_position_embeddings": 2048,
    },
    # Not offered by the CLI; exercises the q/k/v bias path of Qwen2 in tests.
    "qwen2-tiny": {**_QWEN2, **_shape(256, 3, 8, 2, 512), "max_position_embeddings": 2048},
    # DeepSeek-V3 in miniature: MLA with a q LoRA, one dense layer then MoE layers (8 routed
    # experts, top-2 over 2 of 4 groups, noaux_tc, one shared expert), one MTP module.
    "deepseek-tiny": {
        **_DEEPSEEK_V3,
        **_shape(256, 3, 4, 4, 512),
        "max_position_embeddings": 2048,
        "q_lora_rank": 96,
        **_DEEPSEEK_TINY_DIMS,
        "n_shared_experts": 1,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 1,
        "num_nextn_predict_layers": 1,
    },
    # Not offered by the CLI: DeepSeek-V2's variant (no q LoRA, softmax routing limited to
    # groups, two shared experts, YaRN RoPE whose mscale also scales the softmax).
    "deepseek-v2-tiny": {
        **_DEEPSEEK_V3,
        **_shape(256, 2, 4, 4, 512),
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "max_position_embeddings": 4096,
        "q_lora_rank": None,
        **_DEEPSEEK_TINY_DIMS,
        "n_shared_experts": 2,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 0,
        "scoring_func": "softmax",
        "topk_method": "group_limited_greedy",
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
    },
    # Qwen3-MoE in miniature: Qwen3 attention, a dense first layer, 8 experts top-2.
    "qwen3-moe-tiny": {
        **_QWEN3_MOE,
        **_shape(256, 3, 8, 2, 512),
        "head_dim": 32,
        "max_position_embeddings": 2048,
        "moe_intermediate_size": 128,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "mlp_only_layers": [0],
    },
}


def preset_config(preset: str) -> dict[str, Any]:
    """The full ``config.json`` dict of ``preset``."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    return {
        **PRESETS[preset],
        "vocab_size": PRESET_VOCAB_SIZE,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": "float32",
        "initializer_range": 0.02,
    }


def random_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors. Scales keep residual updates and logits lively, so greedy
    decoding of a random model still depends on its context instead of repeating one token."""
    generator = torch.Generator().manual_seed(seed)
    hidden = config.hidden_size
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(expected_tensor_names(config)):
        shape = _tensor_shape(config, name)
        if name.endswith("norm.weight"):
            tensor = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        elif name.endswith("e_score_correction_bias"):
            tensor = 0.1 * torch.randn(shape, generator=generator)
        elif (
            name.endswith("shared_head.head.weight")
            or name == "lm_head.weight"
            or (name == "model.embed_tokens.weight" and config.tie_word_embeddings)
        ):
            tensor = torch.randn(shape, generator=generator) * (2.0 / hidden**0.5)
        elif name.endswith("embed_tokens.weight"):
            tensor = torch.randn(shape, generator=generator)
        elif name.endswith(".bias"):
            tensor = 0.1 * torch.randn(shape, generator=generator)
        else:
            # ~1/sqrt(fan_in): every layer changes the residual stream noticeably.
            tensor = torch.randn(shape, generator=generator) * (1.0 / shape[1] ** 0.5)
        tensors[name] = tensor.contiguous()
    return tensors


def _tensor_shape(config: ModelConfig, name: str) -> tuple[int, ...]:
    hidden, head_dim = config.hidden_size, config.head_dim
    q_size, kv_size = config.num_heads * head_dim, config.num_kv_heads * head_dim
    inter, vocab = config.intermediate_size, config.vocab_size
    suffix = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "lm_head.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_size, hidden),
        "self_attn.k_proj.weight": (kv_size, hidden),
        "self_attn.v_proj.weight": (kv_size, hidden),
        "self_attn.q_proj.bias": (q_size,),
        "self_attn.k_proj.bias": (kv_size,),
        "self_attn.v_proj.bias": (kv_size,),
        "self_attn.o_proj.weight": (hidden, q_size),
        "self_attn.o_proj.bias": (hidden,),
        "self_attn.q_norm.weight": (head_dim,),
        "self_attn.k_norm.weight": (head_dim,),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        # DeepSeek's MTP modules.
        "embed_tokens.weight": (vocab, hidden),
        "enorm.weight": (hidden,),
        "hnorm.weight": (hidden,),
        "eh_proj.weight": (hidden, 2 * hidden),
        "shared_head.norm.weight": (hidden,),
        "shared_head.head.weight": (vocab, hidden),
    }
    mla, moe = config.mla, config.moe
    if mla is not None:
        heads, qk = config.num_heads, mla.qk_head_dim
        shapes |= {
            "self_attn.q_proj.weight": (heads * qk, hidden),
            "self_attn.q_a_proj.weight": (mla.q_lora_rank or 0, hidden),
            "self_attn.q_a_layernorm.weight": (mla.q_lora_rank or 0,),
            "self_attn.q_b_proj.weight": (heads * qk, mla.q_lora_rank or 0),
            "self_attn.kv_a_proj_with_mqa.weight": (mla.latent_dim, hidden),
            "self_attn.kv_a_layernorm.weight": (mla.kv_lora_rank,),
            "self_attn.kv_b_proj.weight": (
                heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                mla.kv_lora_rank,
            ),
            "self_attn.o_proj.weight": (hidden, heads * mla.v_head_dim),
        }
    if moe is not None:
        expert, shared = moe.intermediate_size, moe.num_shared_experts * moe.intermediate_size
        shapes |= {
            "mlp.gate.weight": (moe.num_experts, hidden),
            "mlp.gate.e_score_correction_bias": (moe.num_experts,),
            "mlp.shared_experts.gate_proj.weight": (shared, hidden),
            "mlp.shared_experts.up_proj.weight": (shared, hidden),
            "mlp.shared_experts.down_proj.weight": (hidden, shared),
            "mlp.experts.gate_proj.weight": (expert, hidden),
            "mlp.experts.up_proj.weight": (expert, hidden),
            "mlp.experts.down_proj.weight": (hidden, expert),
        }
        # One entry for every expert: drop the expert index.
        suffix = re.sub(r"^mlp\.experts\.\d+\.", "mlp.experts.", suffix)
    return shapes[suffix]


def byte_level_tokenizer() -> Tokenizer:
    """Token id b encodes byte b (0..255); specials <s>=256, </s>=257, <pad>=258."""
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    # The ByteLevel alphabet maps each byte to one printable character; order ids by byte value.
    byte_to_char = bytes_to_unicode()
    assert set(byte_to_char.values()) == set(byte_chars)
    vocab = {byte_to_char[b]: b for b in range(NUM_BYTE_TOKENS)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BOS_TOKEN, EOS_TOKEN, PAD_TOKEN])
    return tokenizer


def _tokenizer_config(max_length: int) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": DEFAULT_CHAT_TEMPLATE,
    }


def write_random_checkpoint(preset: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write preset ``preset`` with weights drawn from ``seed`` into ``out_dir``; returns it."""
    raw = preset_config(preset)
    config = ModelConfig.from_dict(raw)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    save_file(random_weights(config, seed), str(out / "model.safetensors"), {"format": "pt"})
    byte_level_tokenizer().save(str(out / "tokenizer.json"))
    tokenizer_config = _tokenizer_config(config.max_position_embeddings)
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    logger.info("wrote preset %s (seed %d) to %s", preset, seed, out)
    return out
