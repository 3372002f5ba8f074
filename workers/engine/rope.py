"""Rotary position embeddings (RoPE) with the common HF ``rope_scaling`` types.

The inverse-frequency formulas mirror ``transformers.modeling_rope_utils`` operation for
operation (same float32 arithmetic), so cos/sin tables match HF bit for bit or within float
rounding. Rotation is the non-interleaved "rotate half" form that HF Llama/Qwen checkpoints use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from workers.engine import fused
from workers.engine.errors import UnsupportedCheckpointError
from workers.engine.model_config import ModelConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
_INITIAL_TABLE_POSITIONS = 16384


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(base: float, dim: int, params: dict[str, Any]) -> torch.Tensor:
    inv_freq = _default_inv_freq(base, dim)
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between smoothed.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    base: float, dim: int, params: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    original_max = int(params.get("original_max_position_embeddings") or max_position_embeddings)
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / original_max
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_extrapolation = 1.0 / pos_freqs
    inv_interpolation = 1.0 / (factor * pos_freqs)
    inv_freq = (
        inv_interpolation * (1 - extrapolation_weight) + inv_extrapolation * extrapolation_weight
    )
    return inv_freq, float(attention_factor)


def compute_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Static inverse frequencies [rope_dim // 2] (float32) and the cos/sin scale factor.

    For ``dynamic`` this is the unscaled table; `RotaryEmbedding` rescales long sequences.
    """
    params = config.rope_scaling or {}
    rope_type = str(params.get("rope_type") or params.get("type") or "default")
    base, dim = config.rope_theta, config.rope_dim
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedCheckpointError(
            f"rope_scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedCheckpointError("partial_rotary_factor != 1 is not supported")
    if rope_type in ("default", "dynamic"):
        return _default_inv_freq(base, dim), 1.0
    if rope_type == "linear":
        return _default_inv_freq(base, dim) / float(params["factor"]), 1.0
    if rope_type == "llama3":
        merged = {"original_max_position_embeddings": config.max_position_embeddings, **params}
        return _llama3_inv_freq(base, dim, merged), 1.0
    return _yarn_inv_freq(base, dim, params, config.max_position_embeddings)


@dataclass(frozen=True)
class RotaryTables:
    """Rotation factors of one step, in the activation dtype, shaped [T, 1, head_dim].

    HF rotates ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = (-x2, x1)`` and
    ``cos``/``sin`` repeated over both halves. ``roll(x, D/2) = (x2, x1)`` times
    ``sin_signed = (-sin, sin)`` is the same product bit for bit, in fewer kernels.
    """

    cos: torch.Tensor
    sin_signed: torch.Tensor

    def rotate(self, x: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        """x [T, heads, head_dim] -> rotated copy; with ``in_place``, x itself rotated where
        the fused CPU op applies (a copy elsewhere: use the result either way)."""
        if in_place and fused.rotate_(x, self.cos, self.sin_signed) is not None:
            return x
        return x * self.cos + x.roll(x.shape[-1] // 2, dims=-1) * self.sin_signed


class RotaryEmbedding(torch.nn.Module):
    """cos/sin lookup by absolute position, from a float32 table grown on demand."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = compute_inv_freq(config)
        params = config.rope_scaling or {}
        self.is_dynamic = params.get("rope_type") == "dynamic"
        self.dynamic_factor = float(params.get("factor", 1.0))
        self.rope_theta = config.rope_theta
        self.max_position_embeddings = config.max_position_embeddings
        # Plain attributes, not buffers: ``module.to(bfloat16)`` must never round the angles.
        # They follow the device of the positions they are asked for.
        self.inv_freq = inv_freq
        self.cos_sin_cache = torch.empty(0, config.rope_dim)
        # Long-context models (128k-1M positions) would spend hundreds of MB up front.
        self._grow(min(config.max_position_embeddings, _INITIAL_TABLE_POSITIONS), inv_freq.device)

    def reserve(self, num_positions: int, device: torch.device) -> None:
        """Hold at least ``num_positions`` positions on ``device`` now, so that no later step
        regrows the table (a CUDA graph keeps reading the tensor it captured)."""
        if num_positions > self.cos_sin_cache.shape[0] or self.cos_sin_cache.device != device:
            self._grow(max(num_positions, self.cos_sin_cache.shape[0]), device)

    def _grow(self, num_positions: int, device: torch.device) -> None:
        self.inv_freq = self.inv_freq.to(device)
        positions = torch.arange(num_positions, dtype=torch.float32, device=device)
        self.cos_sin_cache = self._table(positions[:, None] * self.inv_freq[None, :])

    def _table(self, freqs: torch.Tensor) -> torch.Tensor:
        """[N, D/2] angles -> [N, D] with the cos half and sin half side by side."""
        return torch.cat(
            (freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling), dim=-1
        )

    def _dynamic_angles(self, positions: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        # HF's dynamic NTK raises the base once the sequence outgrows max_position_embeddings;
        # each token's length is the one HF generate would have seen when computing it.
        dim = self.inv_freq.shape[0] * 2
        seq_lens = seq_lens.to(positions.device)
        seq_len = torch.clamp(seq_lens.to(torch.float32), min=self.max_position_embeddings)
        factor = self.dynamic_factor
        base = self.rope_theta * (
            (factor * seq_len / self.max_position_embeddings) - (factor - 1)
        ) ** (dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=positions.device)
        inv_freq = 1.0 / (base[:, None] ** (exponents.to(torch.float32) / dim)[None, :])
        return positions.to(torch.float32)[:, None] * inv_freq

    def cos_sin(
        self,
        positions: torch.Tensor,
        token_seq_lens: torch.Tensor | None = None,
        bound: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, head_dim] (float32) for absolute ``positions`` [T].

        ``token_seq_lens`` [T] is each token's sequence length as HF generate sees it (see
        `model.dynamic_rope_seq_lens`); only the ``dynamic`` type uses it, and only once a
        sequence outgrows max_position_embeddings.
        ``bound``: a number every position is below, known on the host (the step's longest
        sequence); without it the table size is checked against ``positions.max()``, which on
        a GPU waits for the device (and cannot be captured in a CUDA graph).
        """
        if (
            self.is_dynamic
            and token_seq_lens is not None
            and token_seq_lens.numel()
            and int(token_seq_lens.max()) > self.max_position_embeddings
        ):
            table = self._table(self._dynamic_angles(positions, token_seq_lens))
        else:
            if bound is not None:
                needed = bound
            else:
                needed = int(positions.max()) + 1 if positions.numel() else 0
            if (
                needed > self.cos_sin_cache.shape[0]
                or self.cos_sin_cache.device != positions.device
            ):
                cached = self.cos_sin_cache.shape[0]
                self._grow(max(needed, 2 * cached) if needed > cached else cached, positions.device)
            table = self.cos_sin_cache.index_select(0, positions)
        half = table.shape[-1] // 2
        cos = torch.cat((table[:, :half], table[:, :half]), dim=-1)
        sin = torch.cat((table[:, half:], table[:, half:]), dim=-1)
        return cos, sin

    def tables(
        self,
        positions: torch.Tensor,
        dtype: torch.dtype,
        token_seq_lens: torch.Tensor | None = None,
        bound: int | None = None,
    ) -> RotaryTables:
        """`RotaryTables` for one step; cos/sin are cast to ``dtype`` like HF does."""
        cos, sin = self.cos_sin(positions, token_seq_lens, bound)
        half = cos.shape[-1] // 2
        sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return RotaryTables(cos.to(dtype).unsqueeze(1), sin_signed.to(dtype).unsqueeze(1))
