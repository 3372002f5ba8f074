"""Projections on CPU through oneDNN with weights packed once, at load.

Why: ``F.linear`` on CPU calls MKL's GEMM, which re-reads the plain [out, in] weight every step
and, for the few-row GEMMs of decode steps, hardly uses a second thread. oneDNN's linear over a
weight reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, the
path PyTorch's own CPU inference freezing takes) runs SmolLM2-135M's projections 1.3-4x faster
at 16-64 rows, and the 49152-wide LM head 2-4x faster (bench/history/RESULTS-notebook.md,
"Against vLLM's CPU build").

A packed weight is an opaque ``torch._mkldnn`` tensor of the same shape and dtype: `linear`
dispatches on it, `dense` gives the plain tensor back (tests, tools). Packed: 2-D float32
weights, and bfloat16 ones where the CPU has native bfloat16 dot products (oneDNN emulates
them otherwise, slower than MKL). ``PDSERVE_CPU_PREPACK=0`` keeps plain weights (a fallback
should a oneDNN build misbehave).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

ENV_SWITCH = "PDSERVE_CPU_PREPACK"


def prepack_enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in {"0", "false", "no", "off"}


def can_prepack(weight: torch.Tensor) -> bool:
    if weight.dim() != 2 or weight.device.type != "cpu" or weight.is_mkldnn:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight: torch.Tensor) -> nn.Parameter:
    """The [out, in] ``weight`` in oneDNN's layout (a new tensor; ``weight`` is left as it is)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    return nn.Parameter(packed, requires_grad=False)


def dense(weight: torch.Tensor) -> torch.Tensor:
    """The plain [out, in] tensor of a packed or plain weight."""
    return weight.to_dense() if weight.is_mkldnn else weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for plain and packed weights alike."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
