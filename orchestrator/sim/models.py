"""Model presets for the roofline cost model, with numbers from the models' cards / config.json.

Only what prices a forward pass is kept: parameter counts (total, active, expert layout),
the attention shape (FLOPs per attended position) and the KV cache bytes per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

AttentionKind = Literal["gqa", "mla"]


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, dense or mixture-of-experts.

    num_kv_heads: KV heads (GQA); for MLA the latent is one shared "head", replicated on
        every TP rank (docs/design.md §4), so ``num_kv_heads = 1``.
    kv_dim_per_token_layer: elements of KV per token per layer (GQA: 2 * kv_heads * head_dim;
        MLA: latent + rope key).
    attn_flops_per_position: FLOPs per (query token, attended position) per layer, summed
        over heads (QK^T plus PV, 2 FLOPs per multiply-add).
    MoE: ``num_moe_layers`` layers of ``num_experts`` routed experts of ``expert_params``
        each, ``experts_per_token`` active; everything else counts as dense.
    num_mtp_modules: multi-token-prediction modules the checkpoint ships (DeepSeek-V3: one):
        each is one decoder layer like the model's MoE layers, a projection of the hidden
        state and the token embedding (2 h x h) and the output head (``vocab_size`` x h), the
        draft proposer of speculative decoding's ``mtp`` method. ``vocab_size``: only the
        head of such a module needs it (0: not given).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    attention: AttentionKind
    kv_dim_per_token_layer: int
    attn_flops_per_position: int
    total_params: float
    active_params: float
    weight_bytes: float  # bytes per parameter as served (BF16: 2, FP8: 1)
    kv_bytes_per_element: float = 2.0
    # Decode attention FLOPs per attended position when it differs from prefill's (MLA decode
    # absorbs the up-projections and attends in the 512-d latent: more FLOPs, fewer bytes).
    decode_attn_flops_per_position: int = 0
    num_moe_layers: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    expert_params: float = 0.0
    num_mtp_modules: int = 0
    vocab_size: int = 0

    def __post_init__(self) -> None:
        if self.active_params > self.total_params or self.active_params <= 0:
            raise ValueError(f"{self.name}: need 0 < active_params <= total_params")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"{self.name}: experts_per_token out of range")
        if self.dense_params < 0:
            raise ValueError(f"{self.name}: routed experts exceed total_params")
        if self.num_mtp_modules and self.vocab_size < 1:
            raise ValueError(f"{self.name}: an MTP module's output head needs vocab_size")

    @property
    def routed_params(self) -> float:
        return self.num_moe_layers * self.num_experts * self.expert_params

    @property
    def dense_params(self) -> float:
        """Parameters every token uses: attention, embeddings, shared experts, dense MLPs."""
        return self.total_params - self.routed_params

    @property
    def kv_bytes_per_token(self) -> float:
        return self.num_layers * self.kv_dim_per_token_layer * self.kv_bytes_per_element

    @property
    def layer_dense_params(self) -> float:
        """One layer's share of the dense parameters, embedding and output head left out."""
        return max(0.0, self.dense_params - 2.0 * self.vocab_size * self.hidden_size) / (
            self.num_layers
        )

    @property
    def mtp_dense_params(self) -> float:
        """Parameters an MTP pass reads whatever it routes to: its layer's dense share, the
        2h x h projection and the output head (the embedding is a lookup, not a read)."""
        h = self.hidden_size
        return self.layer_dense_params + 2.0 * h * h + self.vocab_size * h

    @property
    def mtp_active_params(self) -> float:
        """Parameters an MTP pass multiplies each position by: the dense part and the routed
        experts that position selects."""
        return self.mtp_dense_params + self.experts_per_token * self.expert_params

    def expert_fraction_read(self, num_tokens: float) -> float:
        """Expected fraction of routed experts a step of ``num_tokens`` touches, if routing
        were uniform: 1 - (1 - k/E)^tokens. Small decode batches read few experts."""
        if not self.num_experts:
            return 0.0
        return 1.0 - (1.0 - self.experts_per_token / self.num_experts) ** num_tokens


def _swiglu(hidden: int, intermediate: int) -> float:
    return 3.0 * hidden * intermediate  # gate, up, down


MODELS: dict[str, ModelSpec] = {
    # meta-llama/Meta-Llama-3-70B config.json: 80 layers, hidden 8192, 64 query / 8 KV heads,
    # head_dim 128, intermediate 28672, vocab 128256; 70.6B parameters; served in BF16.
    "llama-3-70b": ModelSpec(
        name="Llama-3-70B",
        num_layers=80,
        hidden_size=8192,
        num_heads=64,
        num_kv_heads=8,
        attention="gqa",
        kv_dim_per_token_layer=2 * 8 * 128,
        attn_flops_per_position=2 * 64 * (128 + 128),
        total_params=70.6e9,
        active_params=70.6e9,
        weight_bytes=2.0,
    ),
    # Qwen/Qwen3-Coder-480B-A35B-Instruct model card / config.json: 480B total, 35B active,
    # 62 layers, hidden 6144, 96 query / 8 KV heads (head_dim 128), 160 experts of
    # moe_intermediate 2560, 8 active; every layer is MoE; served in BF16.
    "qwen3-coder-480b": ModelSpec(
        name="Qwen3-Coder-480B-like (GQA MoE)",
        num_layers=62,
        hidden_size=6144,
        num_heads=96,
        num_kv_heads=8,
        attention="gqa",
        kv_dim_per_token_layer=2 * 8 * 128,
        attn_flops_per_position=2 * 96 * (128 + 128),
        total_params=480e9,
        active_params=35e9,
        weight_bytes=2.0,
        num_moe_layers=62,
        num_experts=160,
        experts_per_token=8,
        expert_params=_swiglu(6144, 2560),
    ),
    # deepseek-ai/DeepSeek-R1 (V3 architecture) model card / config.json: 671B total, 37B
    # active, 61 layers (first 3 dense), hidden 7168, 128 heads, MLA with kv_lora_rank 512 +
    # qk_rope_head_dim 64 cached per token and layer, q/k head dim 128+64, v head dim 128;
    # 256 routed experts of moe_intermediate 2048 (8 active) + 1 shared; weights FP8 as released;
    # vocab_size 129280 and num_nextn_predict_layers 1 (one MTP module).
    # Prefill attention runs per head with the decompressed K/V: (192 + 128) per position.
    "deepseek-r1": ModelSpec(
        name="DeepSeek-R1-like (MLA MoE)",
        num_layers=61,
        hidden_size=7168,
        num_heads=128,
        num_kv_heads=1,
        attention="mla",
        kv_dim_per_token_layer=512 + 64,
        attn_flops_per_position=2 * 128 * (192 + 128),
        total_params=671e9,
        active_params=37e9,
        weight_bytes=1.0,
        decode_attn_flops_per_position=2 * 128 * ((512 + 64) + 512),
        num_moe_layers=58,
        num_experts=256,
        experts_per_token=8,
        expert_params=_swiglu(7168, 2048),
        num_mtp_modules=1,
        vocab_size=129280,
    ),
}
