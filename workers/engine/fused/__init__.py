"""The decoder layer's element-wise steps fused into one pass each on the CPU (`csrc/elementwise.cpp`,
built into the engine's CPU kernel library by `workers/engine/attention/_build_cpu.py`).

Each function here returns its result, or None where the fused op does not apply: a tensor not
on the CPU or not float32 / bfloat16, the library not built, or the ops switched off with
``PDSERVE_CPU_FUSED_OPS=0`` (for A/B measurements). The caller then runs its PyTorch code, whose
results these equal in bfloat16 and match within a unit in the last place in float32 (the C++
file says where they can differ).

Used on CPUs with AVX-512 only, as the attention kernels: their AVX2 copies (built for a
CPU without AVX-512 and forced on the AVX-512 VM) ran 1.2-6x slower than PyTorch's own
kernels at SmolLM2's shapes, all but RoPE in float32. With AVX-512, a 512-token prefill of
SmolLM2-135M ran ~10% faster in both dtypes, and a decode step 2.5% (float32) to 10-20%
(bfloat16) faster (bench/history/RESULTS-notebook.md, "Fused element-wise steps").
"""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace
from typing import Any

import torch

from workers.engine.attention.cpu_kernel import LIBRARY, preferred

ENV_SWITCH = "PDSERVE_CPU_FUSED_OPS"
_DTYPES = (torch.float32, torch.bfloat16)

_lock = threading.Lock()
_ops: Any = None  # torch.ops.pdserve once loaded, SimpleNamespace() when unusable


def _load() -> Any:
    global _ops
    if _ops is not None:  # every op call asks: no lock once settled
        return _ops
    with _lock:
        if _ops is None:
            # Settled once, in one assignment: a thread reading `_ops` unlocked never sees a
            # half-made decision.
            loaded: Any = SimpleNamespace()
            if os.environ.get(ENV_SWITCH, "1") != "0" and preferred() and LIBRARY.is_file():
                try:
                    torch.ops.load_library(str(LIBRARY))
                    loaded = torch.ops.pdserve
                except OSError:  # a stale build: the attention loader says so once
                    pass
            _ops = loaded
        return _ops


def enabled() -> bool:
    """Whether the fused ops are loaded and on."""
    return not isinstance(_load(), SimpleNamespace)


def _applies(*tensors: torch.Tensor) -> bool:
    first = tensors[0]
    return (
        first.device.type == "cpu"
        and first.dtype in _DTYPES
        and all(t.dtype == first.dtype and t.device.type == "cpu" for t in tensors)
        and enabled()
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm over x's last dimension times ``weight``, as `RMSNorm.forward` computes it."""
    if not _applies(x, weight) or x.dim() < 1 or x.stride(-1) != 1:
        return None
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape, dtype=x.dtype)
    _ops.rms_norm(out, rows, weight, eps)
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x + residual, RMSNorm(x + residual) * weight) for [N, H] rows, in one pass."""
    if not _applies(x, residual, weight) or x.dim() != 2 or residual.shape != x.shape:
        return None
    if x.stride(1) != 1 or residual.stride(1) != 1:
        return None
    total = torch.empty(x.shape, dtype=x.dtype)
    out = torch.empty(x.shape, dtype=x.dtype)
    _ops.add_rms_norm(total, out, x, residual, weight, eps)
    return total, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up from the fused gate|up projection's [N, 2I] output, as [N, I]."""
    if not _applies(gate_up) or gate_up.dim() != 2 or gate_up.stride(1) != 1:
        return None
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
    _ops.silu_mul(out, gate_up)
    return out


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor | None:
    """RoPE on x [T, heads, D] in place (`RotaryTables.rotate`'s arithmetic); returns x."""
    if not _applies(x, cos, sin_signed) or x.dim() != 3 or x.stride(2) != 1:
        return None
    if not (cos.is_contiguous() and sin_signed.is_contiguous()):
        return None
    _ops.rotate_(x, cos, sin_signed)
    return x


__all__ = ["ENV_SWITCH", "add_rms_norm", "enabled", "rms_norm", "rotate_", "silu_mul"]
