"""Model hyper-parameters read from an HF ``config.json``.

Dense Llama-family models (Llama, Mistral, Qwen2, Qwen3), and the mixture-of-experts families:
DeepSeek-V2 / V3 (Multi-head Latent Attention, `MLAConfig`, plus routed and shared experts) and
Qwen3-MoE (GQA attention, routed experts), whose expert layers `MoEConfig` describes.

Under MLA the KV cache holds one compressed latent per token and layer: ``num_kv_heads`` is 1
and ``head_dim`` the latent width ``kv_lora_rank + qk_rope_head_dim`` (the "head" the pages,
the pool and the transfer see), with no separate V (``kv_planes`` 1).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workers.engine.errors import UnsupportedCheckpointError


@dataclass(frozen=True)
class ArchitectureFamily:
    """What an HF ``architectures`` entry implies, and the defaults its transformers config
    class gives the keys a ``config.json`` may leave out."""

    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    # q/k/v biases: None reads ``attention_bias`` (default False); a bool is fixed whatever the
    # key says (transformers' Mistral attention never has them, Qwen2's always does).
    qkv_bias: bool | None
    o_proj_bias: bool  # ``attention_bias`` gives o_proj a bias too (Llama, Qwen3; not Qwen2)
    max_position_embeddings: int
    sliding_window: int | None
    # Whether that window is on when ``use_sliding_window`` is absent: only Qwen2 / Qwen3 have
    # the switch (off by default); the engine honours it in every family.
    use_sliding_window: bool
    # "mla": DeepSeek's latent attention (V2 / V3); "moe": routed experts (Qwen3-MoE); None: dense.
    kind: str | None = None


# The architectures we can run. Defaults are those of transformers' LlamaConfig, MistralConfig,
# Qwen2Config and Qwen3Config.
SUPPORTED_ARCHITECTURES: dict[str, ArchitectureFamily] = {
    "LlamaForCausalLM": ArchitectureFamily(
        qk_norm=False,
        qkv_bias=None,
        o_proj_bias=True,
        max_position_embeddings=2048,
        sliding_window=None,
        use_sliding_window=True,
    ),
    "MistralForCausalLM": ArchitectureFamily(
        qk_norm=False,
        qkv_bias=False,
        o_proj_bias=False,
        max_position_embeddings=131072,
        sliding_window=4096,
        use_sliding_window=True,
    ),
    "Qwen2ForCausalLM": ArchitectureFamily(
        qk_norm=False,
        qkv_bias=True,
        o_proj_bias=False,
        max_position_embeddings=32768,
        sliding_window=4096,
        use_sliding_window=False,
    ),
    "Qwen3ForCausalLM": ArchitectureFamily(
        qk_norm=True,
        qkv_bias=None,
        o_proj_bias=True,
        max_position_embeddings=32768,
        sliding_window=4096,
        use_sliding_window=False,
    ),
    "Qwen3MoeForCausalLM": ArchitectureFamily(
        qk_norm=True,
        qkv_bias=None,
        o_proj_bias=True,
        max_position_embeddings=32768,
        sliding_window=4096,
        use_sliding_window=False,
        kind="moe",
    ),
    "DeepseekV2ForCausalLM": ArchitectureFamily(
        qk_norm=False,
        qkv_bias=False,
        o_proj_bias=False,
        max_position_embeddings=2048,
        sliding_window=None,
        use_sliding_window=False,
        kind="mla",
    ),
    "DeepseekV3ForCausalLM": ArchitectureFamily(
        qk_norm=False,
        qkv_bias=False,
        o_proj_bias=False,
        max_position_embeddings=4096,
        sliding_window=None,
        use_sliding_window=False,
        kind="mla",
    ),
}

# RoPE types whose pretraining length a top-level ``original_max_position_embeddings`` sets,
# over the one in the RoPE dict (transformers' ``standardize_rope_params``; Phi3 keeps it there).
_TOP_LEVEL_ORIGINAL_MAX_TYPES = ("llama3", "yarn", "longrope")


def _sliding_window(raw: dict[str, Any], family: ArchitectureFamily) -> int | None:
    """The window of a checkpoint that uses sliding-window attention, else None. Qwen2 /
    Qwen3 configs carry a ``sliding_window`` size that only ``use_sliding_window`` turns on;
    Mistral's is on whenever it is set, and 4096 when the key is absent."""
    window = raw.get("sliding_window", family.sliding_window)
    if window is None or not raw.get("use_sliding_window", family.use_sliding_window):
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise UnsupportedCheckpointError(f"sliding_window must be a positive integer: {window!r}")
    return window


def _rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    """The RoPE dict as transformers picks it: ``rope_scaling`` (transformers < 5) before
    ``rope_parameters`` (transformers 5, which always carries ``rope_type`` and ``rope_theta``)."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters")
    return params if isinstance(params, dict) else {}


def _rope_theta(raw: dict[str, Any]) -> float:
    # transformers only fills the dict's ``rope_theta`` from the top-level key when it is missing.
    return float(_rope_params(raw).get("rope_theta") or raw.get("rope_theta") or 10000.0)


def _rope_scaling(raw: dict[str, Any]) -> dict[str, Any] | None:
    """The RoPE scaling dict, or None for plain RoPE (``rope_type`` missing or ``"default"``)."""
    params = _rope_params(raw)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return None
    scaling = {**params, "rope_type": rope_type}
    original_max = raw.get("original_max_position_embeddings")
    if rope_type in _TOP_LEVEL_ORIGINAL_MAX_TYPES and original_max is not None:
        scaling["original_max_position_embeddings"] = original_max
    return scaling


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's Multi-head Latent Attention. Per token, ``kv_a_proj_with_mqa`` gives a latent
    ``c_kv`` [kv_lora_rank] (RMS-normed) and one shared RoPE key ``k_pe`` [qk_rope_head_dim];
    ``kv_b_proj`` up-projects ``c_kv`` to each head's no-RoPE key and its value."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None  # None: one ``q_proj``; else q_a_proj -> q_a_layernorm -> q_b_proj
    # RoPE dimensions in interleaved pairs (DeepSeek's layout; V2 always, V3's
    # ``rope_interleave``) rather than in halves.
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise UnsupportedCheckpointError(f"config value {name} must be positive")
        if self.qk_rope_head_dim % 2:
            raise UnsupportedCheckpointError("qk_rope_head_dim must be even")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise UnsupportedCheckpointError("q_lora_rank must be positive or null")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one token's cached latent: ``c_kv`` then the rotated ``k_pe``."""
        return self.kv_lora_rank + self.qk_rope_head_dim


SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts (and DeepSeek's always-on shared experts) of the MoE layers.

    Routing: scores = ``scoring_func`` of the router logits (float32); ``topk_method`` picks
    ``top_k`` experts: ``greedy`` the best scores, ``group_limited_greedy`` only within the
    ``topk_group`` groups (of ``n_group``) whose best score is highest, ``noaux_tc`` the same on
    groups ranked by their two best scores after adding ``e_score_correction_bias`` (which only
    steers the choice; the weights are the unbiased scores). Weights are renormalised to sum to
    1 with ``norm_topk_prob``, then multiplied by ``routed_scaling_factor``.
    """

    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    num_shared_experts: int  # DeepSeek: one dense MLP of num_shared * intermediate_size columns
    scoring_func: str
    topk_method: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    # Per layer: True where the MLP is the expert layer (others are dense MLPs).
    moe_layers: tuple[bool, ...]

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise UnsupportedCheckpointError(
                f"num_experts_per_tok ({self.top_k}) must be in 1..{self.num_experts} experts"
            )
        if self.intermediate_size < 1 or self.num_shared_experts < 0:
            raise UnsupportedCheckpointError("moe_intermediate_size must be positive")
        if self.scoring_func not in SCORING_FUNCS:
            raise UnsupportedCheckpointError(
                f"scoring_func {self.scoring_func!r} is not supported; supported: {SCORING_FUNCS}"
            )
        if self.topk_method not in TOPK_METHODS:
            raise UnsupportedCheckpointError(
                f"topk_method {self.topk_method!r} is not supported; supported: {TOPK_METHODS}"
            )
        if self.topk_method != "greedy":
            if self.n_group < 1 or self.num_experts % self.n_group:
                raise UnsupportedCheckpointError(
                    f"n_group ({self.n_group}) must divide n_routed_experts ({self.num_experts})"
                )
            if not 1 <= self.topk_group <= self.n_group:
                raise UnsupportedCheckpointError(
                    f"topk_group ({self.topk_group}) must be in 1..n_group ({self.n_group})"
                )
            per_group = self.num_experts // self.n_group
            if self.topk_method == "noaux_tc" and per_group < 2:
                raise UnsupportedCheckpointError("noaux_tc needs at least 2 experts per group")
            if self.top_k > self.topk_group * per_group:
                raise UnsupportedCheckpointError(
                    f"num_experts_per_tok ({self.top_k}) exceeds the experts of topk_group groups"
                )


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def _mla_config(raw: dict[str, Any], arch: str) -> MLAConfig:
    if raw.get("attention_bias"):
        raise UnsupportedCheckpointError("attention_bias is not supported for MLA checkpoints")
    return MLAConfig(
        kv_lora_rank=int(raw.get("kv_lora_rank", 512)),
        qk_nope_head_dim=int(raw.get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=int(raw.get("qk_rope_head_dim", 64)),
        v_head_dim=int(raw.get("v_head_dim") or 128),
        q_lora_rank=_int_or_none(raw.get("q_lora_rank", 1536)),
        rope_interleave=arch == "DeepseekV2ForCausalLM" or bool(raw.get("rope_interleave", True)),
    )


def _moe_config(raw: dict[str, Any], arch: str, num_layers: int) -> MoEConfig:
    if arch == "Qwen3MoeForCausalLM":
        num_experts = int(raw.get("num_experts", 128))
        step = int(raw.get("decoder_sparse_step", 1))
        dense_only = set(raw.get("mlp_only_layers") or [])
        moe_layers = tuple(
            i not in dense_only and num_experts > 0 and step > 0 and (i + 1) % step == 0
            for i in range(num_layers)
        )
        return MoEConfig(
            num_experts=num_experts,
            top_k=int(raw.get("num_experts_per_tok", 8)),
            intermediate_size=int(raw.get("moe_intermediate_size", 768)),
            num_shared_experts=0,
            scoring_func="softmax",
            topk_method="greedy",
            n_group=1,
            topk_group=1,
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            routed_scaling_factor=1.0,
            moe_layers=moe_layers,
        )
    v3 = arch == "DeepseekV3ForCausalLM"
    first_dense = int(raw.get("first_k_dense_replace", 3 if v3 else 0))
    freq = int(raw.get("moe_layer_freq", 1))
    if freq != 1:
        # transformers ignores the key (every layer past the dense ones is MoE); so do we.
        raise UnsupportedCheckpointError(f"moe_layer_freq {freq} is not supported (only 1)")
    n_group = raw.get("n_group")
    topk_group = raw.get("topk_group")
    return MoEConfig(
        num_experts=int(raw.get("n_routed_experts", 256 if v3 else 64)),
        top_k=int(raw.get("num_experts_per_tok") or (8 if v3 else 6)),
        intermediate_size=int(raw.get("moe_intermediate_size", 2048 if v3 else 1407)),
        num_shared_experts=int(raw.get("n_shared_experts") or 0),
        scoring_func=str(raw.get("scoring_func") or ("sigmoid" if v3 else "softmax")),
        topk_method=str(raw.get("topk_method") or ("noaux_tc" if v3 else "greedy")),
        n_group=int(n_group) if n_group is not None else 1,
        topk_group=int(topk_group) if topk_group is not None else 1,
        norm_topk_prob=bool(raw.get("norm_topk_prob", v3)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
        moe_layers=tuple(i >= first_dense for i in range(num_layers)),
    )


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2; Llama / Qwen3 when set)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    o_proj_bias: bool = False  # o_proj carries a bias (Llama / Qwen3 with attention_bias)
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    torch_dtype: str = "float32"
    # Sliding-window attention the checkpoint asks for (tokens), None for full attention. The
    # engine attends to the whole sequence, so it is exact only within the window (`max_len`).
    sliding_window: int | None = None
    mla: MLAConfig | None = None  # DeepSeek's latent attention (then num_kv_heads is 1)
    moe: MoEConfig | None = None  # expert layers (DeepSeek, Qwen3-MoE)
    # DeepSeek-V3's multi-token-prediction modules, stored after the last layer (loaded and
    # kept for speculative decoding; the forward pass does not run them).
    num_mtp_layers: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedCheckpointError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise UnsupportedCheckpointError(f"config value {name} must be positive")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedCheckpointError(
                f"unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        try:
            num_heads = int(raw["num_attention_heads"])
            num_layers = int(raw["num_hidden_layers"])
            mla = _mla_config(raw, arch) if family.kind == "mla" else None
            moe = _moe_config(raw, arch, num_layers) if family.kind is not None else None
            hidden = int(raw["hidden_size"])
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            attention_bias = (
                bool(raw.get("attention_bias", False))
                if family.qkv_bias is None
                else family.qkv_bias
            )
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=num_layers,
                num_heads=num_heads,
                # MLA caches one latent "head" per token (see the module docstring).
                num_kv_heads=1 if mla else int(raw.get("num_key_value_heads") or num_heads),
                head_dim=(
                    mla.latent_dim if mla else int(raw.get("head_dim") or hidden // num_heads)
                ),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=_rope_theta(raw),
                max_position_embeddings=int(
                    raw.get("max_position_embeddings", family.max_position_embeddings)
                ),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=attention_bias,
                o_proj_bias=attention_bias and family.o_proj_bias,
                qk_norm=family.qk_norm,
                rope_scaling=_rope_scaling(raw),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                sliding_window=_sliding_window(raw, family),
                mla=mla,
                moe=moe,
                num_mtp_layers=int(raw.get("num_nextn_predict_layers") or 0) if mla else 0,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UnsupportedCheckpointError(f"malformed config.json: {exc}") from exc

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise UnsupportedCheckpointError(f"{path} not found: not an HF checkpoint directory")
        return cls.from_dict(json.loads(path.read_text()))

    @property
    def max_len(self) -> int:
        """The longest sequence this engine computes as the checkpoint defines it: the position
        limit, and the sliding window when there is one (full attention differs past it)."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @property
    def is_mla(self) -> bool:
        return self.mla is not None

    @property
    def kv_planes(self) -> int:
        """Tensors per cached token and head: K and V (2), or MLA's one latent (1)."""
        return 1 if self.mla is not None else 2

    @property
    def rope_dim(self) -> int:
        """Dimensions RoPE rotates: the whole head, or MLA's ``qk_rope_head_dim`` part."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @property
    def attention_scale(self) -> float:
        """Softmax scale: ``head_dim ** -0.5``; under MLA that of the up-projected query /
        key width (``qk_nope + qk_rope``), times YaRN's ``mscale(factor, mscale_all_dim) ** 2``
        when the RoPE scaling sets ``mscale_all_dim`` (DeepSeek's long-context models)."""
        if self.mla is None:
            return float(self.head_dim**-0.5)
        scale = float(self.mla.qk_head_dim**-0.5)
        params = self.rope_scaling or {}
        mscale_all_dim = params.get("mscale_all_dim")
        factor = float(params.get("factor") or 1.0)
        if mscale_all_dim and factor > 1:
            mscale = 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0
            scale *= mscale * mscale
        return scale

    def kv_page_bytes(
        self, page_size: int, element_size: int, num_kv_heads: int | None = None
    ) -> int:
        """Bytes of one KV page over every layer (K and V, or MLA's latent), values of
        ``element_size`` bytes; ``num_kv_heads``: the heads one rank's pool holds (default: all
        of them)."""
        heads = self.num_kv_heads if num_kv_heads is None else num_kv_heads
        per_head = self.kv_planes * page_size * self.head_dim * element_size
        return self.num_layers * heads * per_head
