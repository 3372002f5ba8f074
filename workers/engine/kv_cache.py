"""The KV pool: one tensor allocated up front, plus page-level read / write / copy helpers.

Layout (see ``attention/base.py``)::

    kv_cache[layer, page, plane, kv_head, slot_in_page, head_dim]

with two planes, 0 (K) and 1 (V), for dense attention, or one plane holding MLA's latent
(``ModelConfig.kv_planes``). One page of one layer is one contiguous byte range, which is what
the KV messenger moves.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workers.engine.model_config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheShape:
    num_layers: int
    num_pages: int
    num_kv_heads: int
    page_size: int
    head_dim: int
    # K and V (2), or MLA's single latent (1): `ModelConfig.kv_planes`.
    kv_planes: int

    def as_tuple(self) -> tuple[int, int, int, int, int, int]:
        """``[layer, page, plane, kv_head, slot, head_dim]``."""
        return (
            self.num_layers,
            self.num_pages,
            self.kv_planes,
            self.num_kv_heads,
            self.page_size,
            self.head_dim,
        )


def page_nbytes(
    model_config: ModelConfig, page_size: int, dtype: torch.dtype, extra_layers: int = 0
) -> int:
    """Bytes one page occupies across all layers (K and V, or MLA's latent); ``extra_layers``:
    layers the pool holds past the model's own (the MTP module's, `workers.engine.mtp_drafter`)."""
    per_layer = (
        model_config.kv_page_bytes(page_size, torch.empty((), dtype=dtype).element_size())
        // model_config.num_layers
    )
    return per_layer * (model_config.num_layers + extra_layers)


def num_pages_for_budget(
    model_config: ModelConfig,
    page_size: int,
    dtype: torch.dtype,
    kv_memory_bytes: int,
    extra_layers: int = 0,
) -> int:
    page_bytes = page_nbytes(model_config, page_size, dtype, extra_layers)
    num_pages = kv_memory_bytes // page_bytes
    if num_pages < 1:
        raise ValueError(f"kv_memory_bytes={kv_memory_bytes} holds no page of {page_bytes} bytes")
    return num_pages


def allocate_kv_cache(
    model_config: ModelConfig,
    num_pages: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    extra_layers: int = 0,
) -> torch.Tensor:
    shape = KVCacheShape(
        num_layers=model_config.num_layers + extra_layers,
        num_pages=num_pages,
        num_kv_heads=model_config.num_kv_heads,
        page_size=page_size,
        head_dim=model_config.head_dim,
        kv_planes=model_config.kv_planes,
    )
    # Zeroed rather than empty: no backend reads unwritten slots, but garbage NaNs there would
    # poison any kernel that masks by multiplication.
    kv_cache = torch.zeros(shape.as_tuple(), dtype=dtype, device=device)
    logger.info(
        "KV pool: %d pages of %d tokens, %.1f MiB (%s)",
        num_pages,
        page_size,
        kv_cache.numel() * kv_cache.element_size() / 2**20,
        dtype,
    )
    return kv_cache


def read_pages(kv_cache: torch.Tensor, page_ids: Sequence[int]) -> torch.Tensor:
    """A copy of the given pages, all layers: ``[num_layers, len(page_ids), planes, H, P, D]``."""
    index = torch.tensor(list(page_ids), dtype=torch.long, device=kv_cache.device)
    return kv_cache.index_select(1, index)


def write_pages(kv_cache: torch.Tensor, page_ids: Sequence[int], data: torch.Tensor) -> None:
    """Inverse of ``read_pages``."""
    if data.shape[1] != len(page_ids) or data.shape[2:] != kv_cache.shape[2:]:
        raise ValueError(f"data of shape {tuple(data.shape)} does not fit {len(page_ids)} pages")
    index = torch.tensor(list(page_ids), dtype=torch.long, device=kv_cache.device)
    kv_cache.index_copy_(1, index, data.to(kv_cache.device, kv_cache.dtype))


def copy_pages(
    src: torch.Tensor, src_page_ids: Sequence[int], dst: torch.Tensor, dst_page_ids: Sequence[int]
) -> None:
    """Copy pages between two pools (or within one); page ids may differ on each side."""
    if len(src_page_ids) != len(dst_page_ids):
        raise ValueError(f"{len(src_page_ids)} source pages for {len(dst_page_ids)} destinations")
    if src.shape[0] != dst.shape[0] or src.shape[2:] != dst.shape[2:]:
        raise ValueError(f"pool shapes differ: {tuple(src.shape)} vs {tuple(dst.shape)}")
    write_pages(dst, dst_page_ids, read_pages(src, src_page_ids))


def page_layer_bytes(kv_cache: torch.Tensor, layer: int, page_id: int) -> bytes:
    """The raw bytes of one page of one layer: exactly what one RDMA write carries."""
    view = kv_cache[layer, page_id]
    assert view.is_contiguous()
    return view.cpu().contiguous().view(torch.uint8).numpy().tobytes()
