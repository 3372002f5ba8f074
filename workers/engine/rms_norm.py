"""Pieces every layer module shares: RMSNorm, uninitialised parameters, the TP reduce hook."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from workers.engine import fused

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
        out = fused.rms_norm(x, self.weight, self.eps)
        if out is not None:
            return out
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Like HF LlamaRMSNorm: normalise in float32, cast back, then apply the weight.
        normed = F.rms_norm(x.to(torch.float32), self.weight.shape, None, self.eps)
        return self.weight * normed.to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, this norm of it): the residual stream's add and the next norm, in one
        pass where the fused CPU op applies."""
        both = fused.add_rms_norm(x, residual, self.weight, self.eps)
        if both is not None:
            return both
        total = residual + x
        return total, self(total)
