"""Projections on CPU through oneDNN with weights packed once, at load.

Why: ``F.linear`` on CPU calls MKL's GEMM, which re-reads the plain [out, in] weight every step
and, for the few-row GEMMs of decode steps, hardly uses a second thread. oneDNN's linear over a
weight reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, the
path PyTorch's own CPU inference freezing takes) runs SmolLM2-135M's projections 1.3-4x faster
at 16-64 rows, and the 49152-wide LM head 2-4x faster (bench/history/RESULTS-notebook.md,
"Against vLLM's CPU build").

A packed weight is an opaque ``torch._mkldnn`` tensor of the same shape and dtype: `linear`
dispatches on it, `dense` gives the plain tensor back (tests, tools). Packed: 2-D float32
weights, and bfloat16 / float16 ones where the CPU has native dot products for them
(AVX512_BF16 or AMX; AVX512_FP16). Elsewhere (an AVX2-only CPU, say) a half-precision weight
stays plain and gets a float32 packed copy of its values beside it (`FLOAT32_COPY`): GEMMs of
two rows or more run in float32 on activations cast up and are rounded back once, which is what
a half-precision GEMM with float32 accumulation computes; one-row GEMMs (a lone sequence's
decode step, memory-bound) read the half-precision weight, half the bytes. On a 2-vCPU AVX2
machine, SmolLM2-135M in bfloat16: decode at batch 16 3x and prefill 6x faster than with the
bfloat16 GEMMs alone, batch 1 unchanged, for three times the projections' bfloat16 bytes
(bench/history/RESULTS-notebook.md, "bfloat16 on a CPU without bfloat16 dot products").
``PDSERVE_CPU_PREPACK=0`` keeps plain weights (a fallback should a oneDNN build misbehave).

oneDNN builds (JIT-compiles) a kernel for each shape it sees and keeps it: a GEMM of every
new row count costs ~0.5 MB of memory for as long as the process lives and a JIT pass the
first time. A prefill worker whose prompts are of any length sees hundreds of row counts:
whole prompts of 1500-1900 tokens grew the `small` preset's engine from 0.57 to 1.6 GB over
400 prompts, still growing. So the first `MAX_EXACT_COUNTS` row counts above `EXACT_ROWS`
that a process meets run as they are (the common ones: a chunk budget's steps), and any other
on rows padded with zeros up to a bucket (`row_bucket`, at most ~3% more rows, ~32 sizes an
octave). The same prompts then leave the engine flat at 0.87 GB from the 50th on, and take
as long (84.8 s against 84.5-87.4 s). A padded GEMM pays the copy of its input and its extra
rows: 1.01-1.03x a layer's projections at 1700-1731 rows, 1.03-1.07x at 241-256
(bench/history/RESULTS-notebook.md, "Prefill workers' memory"). Up to
`EXACT_ROWS` (decode batches) rows always run as they are: there are few such counts, and
padding one costs a memory-bound GEMM more than it saves.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

ENV_SWITCH = "PDSERVE_CPU_PREPACK"


def prepack_enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in {"0", "false", "no", "off"}


_HALF = (torch.bfloat16, torch.float16)
EXACT_ROWS = 64  # GEMMs of up to this many rows run unpadded (`row_bucket`)
MAX_EXACT_COUNTS = 16  # row counts above EXACT_ROWS run unpadded, the first met (`_run_rows`)
_exact_counts: set[int] = set()
# The attribute of a plain half-precision weight that holds its float32 packed copy (`pack`).
FLOAT32_COPY = "float32_packed"


def can_prepack(weight: torch.Tensor) -> bool:
    if weight.dim() != 2 or weight.device.type != "cpu" or weight.is_mkldnn:
        return False
    if not torch.backends.mkldnn.is_available() or hasattr(weight, FLOAT32_COPY):
        return False
    return weight.dtype == torch.float32 or weight.dtype in _HALF


def native_half(dtype: torch.dtype) -> bool:
    """Whether this CPU has native dot products for half-precision ``dtype`` (oneDNN emulates
    them otherwise, slower than a float32 GEMM)."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def pack(weight: torch.Tensor) -> nn.Parameter:
    """The [out, in] ``weight`` in oneDNN's layout (a new tensor; ``weight`` is left as it is),
    or, for a half-precision weight without native dot products, the weight itself with a
    float32 packed copy beside it (module docstring)."""
    plain = weight.detach()
    if plain.dtype in _HALF and not native_half(plain.dtype):
        parameter = nn.Parameter(plain, requires_grad=False)
        setattr(parameter, FLOAT32_COPY, torch.ops.mkldnn._reorder_linear_weight(plain.float()))
        return parameter
    return nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(plain), requires_grad=False)


def dense(weight: torch.Tensor) -> torch.Tensor:
    """The plain [out, in] tensor of a packed or plain weight."""
    return weight.to_dense() if weight.is_mkldnn else weight


def row_bucket(rows: int) -> int:
    """The rows a padded GEMM of ``rows`` rows runs with (module docstring): as many up to
    `EXACT_ROWS`, then rounded up to a multiple of 32, or of 1/32 of the power of two below
    from 1024 rows on (at most ~3% more rows, ~32 sizes an octave)."""
    if rows <= EXACT_ROWS:
        return rows
    step = max(32, 1 << (rows.bit_length() - 6))
    return -(-rows // step) * step


def _run_rows(rows: int) -> int:
    """The rows a GEMM of ``rows`` rows runs with in this process: as many if they are at most
    `EXACT_ROWS` or among the first `MAX_EXACT_COUNTS` counts above it met, else a bucket."""
    if rows <= EXACT_ROWS or rows in _exact_counts:
        return rows
    if len(_exact_counts) < MAX_EXACT_COUNTS:
        _exact_counts.add(rows)
        return rows
    return row_bucket(rows)


def _onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    padded = _run_rows(rows)
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    full = x.new_empty(padded, x.shape[-1])
    full[:rows] = x.reshape(rows, x.shape[-1])
    full[rows:].zero_()  # discarded rows, but no NaN from stale memory in them
    out = torch.ops.mkldnn._linear_pointwise(full, packed, bias, "none", [], "")
    return out[:rows].reshape(*x.shape[:-1], out.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for plain and packed weights alike."""
    if weight.is_mkldnn:
        return _onednn_linear(x, weight, bias)
    copy = getattr(weight, FLOAT32_COPY, None)
    if copy is None or x.numel() == x.shape[-1]:
        return F.linear(x, weight, bias)
    bias32 = None if bias is None else bias.float()
    return _onednn_linear(x.float(), copy, bias32).to(x.dtype)
