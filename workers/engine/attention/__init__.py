"""Attention backends over the paged HND KV cache, selected by name; implementations load lazily."""

from __future__ import annotations

import importlib.util

import torch

from workers.engine.attention.base import AttentionBackend, AttentionBatch

__all__ = ["BACKEND_NAMES", "AttentionBackend", "AttentionBatch", "create_attention_backend"]

BACKEND_NAMES = ("auto", "torch", "flashinfer")


def _flashinfer_usable(kv_cache: torch.Tensor) -> bool:
    # FlashInfer kernels take half-precision caches only; float32 stays on the torch backend,
    # and so does an MLA latent cache (one plane, values = keys: only the torch backend does it).
    return (
        kv_cache.shape[2] == 2
        and kv_cache.is_cuda
        and kv_cache.dtype in (torch.float16, torch.bfloat16)
        and importlib.util.find_spec("flashinfer") is not None
    )


def create_attention_backend(
    name: str,
    kv_cache: torch.Tensor,
    page_size: int,
    scale: float,
    *,
    num_qo_heads: int | None = None,
) -> AttentionBackend:
    """``auto``: FlashInfer for a half-precision two-plane (K|V) CUDA cache when flashinfer is
    installed, else torch (always for an MLA latent cache). ``scale`` is the softmax scale
    (usually head_dim ** -0.5). ``num_qo_heads`` (query heads per rank) lets FlashInfer plan in
    ``begin_step``; the torch backend ignores it."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")
    if name == "flashinfer" or (name == "auto" and _flashinfer_usable(kv_cache)):
        from workers.engine.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(kv_cache, page_size, scale, num_qo_heads)
    from workers.engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(kv_cache, page_size, scale)
