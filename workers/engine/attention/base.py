"""Attention backend contract.

The engine runs one forward pass per step over a *flattened* batch: the new tokens of every
scheduled sequence (prefill chunks and single decode tokens alike) are concatenated into one
token dimension ``T``. Sequence ``i`` owns tokens ``query_start_loc[i]:query_start_loc[i+1]``.

The KV cache is one tensor per engine, layout HND per page per layer::

    kv_cache[layer, page, plane, kv_head, slot_in_page, head_dim]

so one page of one layer (``[planes, kv_heads, page_size, head_dim]``) is one contiguous byte
range and adjacent page ids are adjacent in memory (the KV messenger relies on both).

The plane axis has two planes, 0 (K) and 1 (V), for dense attention, or one (*latent mode*) for
MLA: one latent row per token and head (``num_kv_heads`` 1, ``head_dim`` the latent width) that
serves as the key and as the value. In latent mode ``forward`` gets ``v=None`` and computes
``softmax(scale * q . k) @ k`` over the cached rows (MQA with V = K) at the full width
``head_dim``; the model slices out the part it needs. Backends that cannot do that refuse a
single-plane cache at construction.

A backend, for each layer:
1. writes the new tokens' K and V (or the latent) into the cache at ``slot_mapping``
   (slot = page * page_size + offset), and then
2. computes causal attention of each new token over its sequence's cached prefix plus the new
   tokens up to and including itself, reading K/V through the sequence's page table.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionBatch:
    """Per-step metadata shared by every layer of one forward pass (built once per step)."""

    # [B + 1] int64 prefix sums of the number of new tokens per sequence.
    query_start_loc: torch.Tensor
    # [B] int64: KV length of each sequence *after* this step's tokens are written.
    seq_lens: torch.Tensor
    # [B] int64: KV length already in the cache before this step (seq_lens - new tokens).
    context_lens: torch.Tensor
    # [B, max_pages] int64 page ids per sequence, padded with -1.
    page_table: torch.Tensor
    # [T] int64 destination slot of each new token (page * page_size + offset).
    slot_mapping: torch.Tensor
    # Python-side copies used to slice without device syncs.
    query_lens_list: tuple[int, ...]
    seq_lens_list: tuple[int, ...]
    # [B] int64 prompt length of each sequence. Not for attention: dynamic RoPE scales every
    # prompt token by it (see `model.dynamic_rope_seq_lens`). None where the step runs whole
    # prompts only (tests, graphs), and ``seq_lens`` then stands in.
    num_prompt_tokens: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens_list))


class AttentionBackend(ABC):
    """Causal attention over a paged HND KV cache for mixed prefill/decode batches.

    Contract: ``forward`` must write the new K/V into ``kv_cache`` *before* reading it, so a
    sequence's new tokens attend to themselves; it must not read pages outside each sequence's
    page table, and it must be correct for any mix of query lengths in one batch.
    """

    name: str = "base"

    def __init__(self, kv_cache: torch.Tensor, page_size: int, scale: float) -> None:
        self.kv_cache = kv_cache
        self.page_size = page_size
        self.scale = scale

    def begin_step(self, batch: AttentionBatch) -> None:  # noqa: B027 - optional hook
        """Called once per forward pass before layer 0 (plan kernels, build indices)."""

    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (RoPE applied).

        ``v`` is None exactly when the cache has one plane (latent mode: ``k`` is the latent,
        stored as is, and the values are the keys); a two-plane cache needs it (ValueError).
        Returns [T, num_heads, head_dim].
        """
