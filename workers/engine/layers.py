"""Building blocks of the decoder: attention, SwiGLU MLP, decoder layer (Llama family; the
DeepSeek / Qwen3-MoE layer swaps in `workers.engine.mla` and `workers.engine.moe`).

Parameters are allocated uninitialised (`torch.empty`); the loader fills them. Projections that
read the same input are fused into one GEMM (``qkv_proj`` = q|k|v rows, ``gate_up_proj`` =
gate|up rows); the loader concatenates HF's separate tensors in that order. Arithmetic follows
HF's Llama/Qwen modelling code step by step (RMSNorm in float32, RoPE cos/sin cast to the
activation dtype) so float32 logits match HF within float rounding.

Under tensor parallelism a layer is built from the rank's local config (its own heads and MLP
columns) and given ``reduce``, the all-reduce (sum) that completes the row-parallel o_proj and
down_proj (see `workers.engine.parallel`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.engine import fused
from workers.engine.attention.base import AttentionBackend, AttentionBatch
from workers.engine.cpu_gemm import linear
from workers.engine.layer_progress import LayerProgress
from workers.engine.mla import MLAttention
from workers.engine.model_config import ModelConfig
from workers.engine.moe import MoE
from workers.engine.rms_norm import Reduce, RMSNorm
from workers.engine.rms_norm import empty_parameter as _empty
from workers.engine.rope import RotaryTables

__all__ = ["MLP", "Attention", "DecoderLayer", "RMSNorm", "Reduce"]


class Attention(nn.Module):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, reduce: Reduce | None = None
    ) -> None:
        super().__init__()
        self.reduce = reduce
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        qkv_rows = self.q_size + 2 * self.kv_size
        self.qkv_proj_weight = _empty(qkv_rows, config.hidden_size, dtype=dtype)
        self.qkv_proj_bias = _empty(qkv_rows, dtype=dtype) if config.attention_bias else None
        self.o_proj_weight = _empty(config.hidden_size, self.q_size, dtype=dtype)
        # Replicated under TP: added once, after the all-reduce of the partial products.
        self.o_proj_bias = _empty(config.hidden_size, dtype=dtype) if config.o_proj_bias else None
        self.q_norm = (
            RMSNorm(config.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None
        )
        self.k_norm = (
            RMSNorm(config.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None
        )

    def forward(
        self,
        layer: int,
        hidden: torch.Tensor,
        rotary: RotaryTables,
        batch: AttentionBatch,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = linear(hidden, self.qkv_proj_weight, self.qkv_proj_bias)
        heads = qkv.view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q_and_k = heads[:, : self.num_heads + self.num_kv_heads]
        v = heads[:, self.num_heads + self.num_kv_heads :]
        if self.q_norm is not None and self.k_norm is not None:
            # Qwen3: per-head norm before RoPE.
            q = rotary.rotate(self.q_norm(q_and_k[:, : self.num_heads]))
            k = rotary.rotate(self.k_norm(q_and_k[:, self.num_heads :]))
        else:
            # q and k are adjacent in the fused projection: rotate them in one go (in place:
            # the projection's output is this step's own).
            rotated = rotary.rotate(q_and_k, in_place=True)
            q, k = rotated[:, : self.num_heads], rotated[:, self.num_heads :]
        out = backend.forward(layer, q, k, v, batch)
        projected = linear(out.reshape(num_tokens, self.q_size), self.o_proj_weight)
        if self.reduce is not None:
            # Every rank's heads have written their KV once this returns on any rank.
            self.reduce(projected)
        if self.o_proj_bias is not None:
            projected += self.o_proj_bias
        return projected


class MLP(nn.Module):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, reduce: Reduce | None = None
    ) -> None:
        super().__init__()
        self.reduce = reduce
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj_weight = _empty(
            2 * config.intermediate_size, config.hidden_size, dtype=dtype
        )
        self.down_proj_weight = _empty(config.hidden_size, config.intermediate_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_proj_weight)
        act = fused.silu_mul(gate_up)
        if act is None:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            # gate and up are strided halves of one GEMM output: `silu(gate) * up` runs the
            # strided elementwise path twice, while multiplying into silu's fresh contiguous
            # output halves the cost (same bits; ~0.7 ms of a 512-token layer on CPU).
            act = F.silu(gate).mul_(up)
        out = linear(act, self.down_proj_weight)
        if self.reduce is not None:
            self.reduce(out)
        return out


class DecoderLayer(nn.Module):
    """``index``: the layer's position, which picks a dense or an expert MLP in MoE models
    (`MoEConfig.moe_layers`; a DeepSeek MTP module's layer, past the last, is an expert one).
    ``tp_size`` / ``tp_rank``: which share of the experts this rank holds."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        reduce: Reduce | None = None,
        index: int = 0,
        tp_size: int = 1,
        tp_rank: int = 0,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn: Attention | MLAttention = (
            MLAttention(config, dtype, reduce) if config.mla else Attention(config, dtype, reduce)
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        moe = config.moe
        self.mlp: MLP | MoE = (
            MoE(config.hidden_size, moe, dtype, reduce, tp_size, tp_rank)
            if moe is not None and (index >= len(moe.moe_layers) or moe.moe_layers[index])
            else MLP(config, dtype, reduce)
        )

    def forward(
        self,
        layer: int,
        hidden: torch.Tensor,
        rotary: RotaryTables,
        batch: AttentionBatch,
        backend: AttentionBackend,
        progress: LayerProgress | None,
    ) -> torch.Tensor:
        attn_out = self.self_attn(layer, self.input_layernorm(hidden), rotary, batch, backend)
        # The layer's KV is in the cache once o_proj ran (under TP: once its all-reduce returned,
        # which no rank passes before every rank wrote its heads): the messenger may ship it.
        if progress is not None:
            progress.mark_layer_done(layer)
        hidden, normed = self.post_attention_layernorm.add_forward(attn_out, hidden)
        return hidden + self.mlp(normed)
