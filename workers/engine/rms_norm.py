"""Pieces every layer module shares: RMSNorm, uninitialised parameters, the TP reduce hook."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# In-place sum of a tensor over the tensor-parallel ranks (None on a single device).
Reduce = Callable[[torch.Tensor], None]


def empty_parameter(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialised, frozen parameter (the loader fills it)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_parameter(size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Like HF LlamaRMSNorm: normalise in float32, cast back, then apply the weight.
        normed = F.rms_norm(x.to(torch.float32), self.weight.shape, None, self.eps)
        return self.weight * normed.to(x.dtype)
