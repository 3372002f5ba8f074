"""DeepSeek's Multi-head Latent Attention (MLA) over a paged latent cache.

Per token the layer caches one latent ``[c_kv | k_pe]`` (``kv_lora_rank + qk_rope_head_dim``
values): ``c_kv`` is the RMS-normed low-rank projection from which ``kv_b_proj`` would
up-project every head's no-RoPE key (``W_UK``) and value (``W_UV``); ``k_pe`` is one RoPE key
shared by all heads. The cache is a one-plane, one-head pool (`ModelConfig.kv_planes`).

Attention runs in the *absorbed* form for prefill and decode alike: ``q_nope · W_UK c_kv`` equals
``(W_UK^T q_nope) · c_kv``, so each head's query is folded into latent space once
(``[q_nope W_UK | q_pe]``, width ``kv_lora_rank + qk_rope_head_dim``) and scored against the
cached latents directly, as multi-query attention whose values are the latents themselves; the
output's ``c_kv`` part is then up-projected by ``W_UV`` per head. Nothing per head is ever
materialised per cached token, which is what makes MLA's cache ~1/50 of a dense one.

The softmax scale is that of the up-projected width (`ModelConfig.attention_scale`). DeepSeek
lays the RoPE dimensions out in interleaved pairs; the loader permutes the rows of the
projections that produce them into rotate-half order (evens, then odds: HF's
``apply_rotary_pos_emb_interleave`` computes exactly that), so the shared rotary code applies
and the cache holds the keys in that order.

Tensor parallelism: query heads (``q_b_proj`` / ``q_proj`` rows, ``kv_b_proj`` rows, ``o_proj``
columns) are split over the ranks; the latent projection is replicated, so every rank computes
and caches the identical latent, and any rank can be a transfer's source.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.engine.attention.base import AttentionBackend, AttentionBatch
from workers.engine.cpu_gemm import linear
from workers.engine.model_config import MLAConfig, ModelConfig
from workers.engine.rms_norm import Reduce, RMSNorm, empty_parameter
from workers.engine.rope import RotaryTables


class MLAttention(nn.Module):
    """One layer's MLA; ``config`` is the rank's local config (its own query heads)."""

    # The loader packs projection weights for oneDNN; these are read through per-head views.
    NOT_PACKED = ("kv_b_proj_weight",)

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, reduce: Reduce | None = None
    ) -> None:
        super().__init__()
        assert config.mla is not None
        mla: MLAConfig = config.mla
        self.mla = mla
        self.reduce = reduce
        self.num_heads = config.num_heads
        hidden = config.hidden_size
        q_rows = self.num_heads * mla.qk_head_dim
        eps = config.rms_norm_eps
        if mla.q_lora_rank is None:
            self.q_proj_weight: nn.Parameter | None = empty_parameter(q_rows, hidden, dtype=dtype)
            self.q_a_proj_weight: nn.Parameter | None = None
            self.q_a_layernorm: RMSNorm | None = None
            self.q_b_proj_weight: nn.Parameter | None = None
        else:
            self.q_proj_weight = None
            self.q_a_proj_weight = empty_parameter(mla.q_lora_rank, hidden, dtype=dtype)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, eps, dtype)
            self.q_b_proj_weight = empty_parameter(q_rows, mla.q_lora_rank, dtype=dtype)
        self.kv_a_proj_with_mqa_weight = empty_parameter(mla.latent_dim, hidden, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, eps, dtype)
        # [heads * (nope + v), kv_lora_rank]: per head, W_UK's rows then W_UV's. Used through
        # per-head batched matmuls (the absorption), never as a projection: not packed.
        self.kv_b_proj_weight = empty_parameter(
            self.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim),
            mla.kv_lora_rank,
            dtype=dtype,
        )
        self.o_proj_weight = empty_parameter(hidden, self.num_heads * mla.v_head_dim, dtype=dtype)

    def deinterleave_rope(self) -> None:
        """Permute the rows that produce the RoPE dimensions from DeepSeek's interleaved pairs
        to rotate-half order (evens, then odds), once, after loading (module docstring)."""
        mla = self.mla
        if not mla.rope_interleave:
            return
        rope = mla.qk_rope_head_dim
        order = torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))
        q_weight = self.q_proj_weight if self.q_proj_weight is not None else self.q_b_proj_weight
        assert q_weight is not None
        per_head = q_weight.data.view(self.num_heads, mla.qk_head_dim, -1)
        per_head[:, mla.qk_nope_head_dim :] = per_head[:, mla.qk_nope_head_dim :][:, order]
        kv_a = self.kv_a_proj_with_mqa_weight.data
        kv_a[mla.kv_lora_rank :] = kv_a[mla.kv_lora_rank :][order]

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [heads, nope, kv_lora_rank], W_UV [heads, v, kv_lora_rank]) as views."""
        mla = self.mla
        per_head = self.kv_b_proj_weight.view(
            self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank
        )
        return per_head[:, : mla.qk_nope_head_dim], per_head[:, mla.qk_nope_head_dim :]

    def queries(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, heads, qk_nope + qk_rope] before RoPE."""
        if self.q_proj_weight is not None:
            q = linear(hidden, self.q_proj_weight)
        else:
            assert self.q_a_proj_weight is not None and self.q_b_proj_weight is not None
            assert self.q_a_layernorm is not None
            q = linear(
                self.q_a_layernorm(linear(hidden, self.q_a_proj_weight)), self.q_b_proj_weight
            )
        return q.view(hidden.shape[0], self.num_heads, self.mla.qk_head_dim)

    def latents(self, hidden: torch.Tensor, rotary: RotaryTables) -> torch.Tensor:
        """[T, 1, kv_lora_rank + qk_rope]: what the cache holds for each new token."""
        kv_lora_rank = self.mla.kv_lora_rank
        compressed = linear(hidden, self.kv_a_proj_with_mqa_weight)
        c_kv = self.kv_a_layernorm(compressed[:, :kv_lora_rank])
        k_pe = rotary.rotate(compressed[:, None, kv_lora_rank:])
        return torch.cat((c_kv[:, None, :], k_pe), dim=-1)

    def forward(
        self,
        layer: int,
        hidden: torch.Tensor,
        rotary: RotaryTables,
        batch: AttentionBatch,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        mla = self.mla
        num_tokens = hidden.shape[0]
        q = self.queries(hidden)
        q_nope, q_pe = q[..., : mla.qk_nope_head_dim], q[..., mla.qk_nope_head_dim :]
        latent = self.latents(hidden, rotary)
        w_uk, w_uv = self.absorbed_weights()
        # [heads, T, nope] @ [heads, nope, kv_lora_rank]: each head's query in latent space.
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        query = torch.cat((q_latent, rotary.rotate(q_pe)), dim=-1)
        out = backend.forward(layer, query, latent, None, batch)
        # The values are the latents: keep their c_kv part and up-project it per head.
        values = torch.bmm(out[..., : mla.kv_lora_rank].transpose(0, 1), w_uv.transpose(1, 2))
        attn = values.transpose(0, 1).reshape(num_tokens, self.num_heads * mla.v_head_dim)
        projected = linear(attn, self.o_proj_weight)
        if self.reduce is not None:
            self.reduce(projected)
        return projected
