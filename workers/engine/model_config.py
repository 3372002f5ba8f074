"""Model hyper-parameters read from an HF ``config.json`` (Llama, Mistral, Qwen2, Qwen3)."""

from __future__ import annotations

import json
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
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(raw.get("head_dim") or hidden // num_heads),
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

    def kv_page_bytes(
        self, page_size: int, element_size: int, num_kv_heads: int | None = None
    ) -> int:
        """Bytes of one KV page over every layer (K and V), values of ``element_size`` bytes;
        ``num_kv_heads``: the heads one rank's pool holds (default: all of them)."""
        heads = self.num_kv_heads if num_kv_heads is None else num_kv_heads
        return 2 * self.num_layers * heads * page_size * self.head_dim * element_size
