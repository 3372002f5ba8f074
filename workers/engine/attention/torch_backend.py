"""Pure-PyTorch attention over the paged HND cache (CPU and any device; the reference backend).

Per step (`begin_step`) the batch is split once into
- *decode* sequences (one new token): attended together in one batched matmul over their pages
  gathered with a single index; keys past each sequence's length are masked;
- *chunk* sequences (several new tokens: prefill chunks, or a whole prompt): one
  ``scaled_dot_product_attention`` call each, causal with the cached context as prefix. A chunk
  without cached context attends over its own new K/V directly, without touching the cache.
GQA is handled by grouping query heads per KV head, never by copying K/V per query head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.engine.attention.base import AttentionBackend, AttentionBatch


@dataclass(frozen=True)
class _DecodePlan:
    token_index: torch.Tensor | None  # [Bd] rows of q / output; None when every row decodes
    page_ids: torch.Tensor  # [Bd * pages] pages to gather (padding repeats a sequence's own page)
    num_seqs: int
    kv_len: int  # pages * page_size, the padded key length
    # [Hk * Bd, 1, kv_len] additive mask (0 or -inf), in (kv head, sequence) batch order.
    key_bias: torch.Tensor


@dataclass(frozen=True)
class _ChunkPlan:
    start: int  # first row of the sequence's new tokens
    end: int
    page_ids: torch.Tensor | None  # [pages] the sequence's pages, None without cached context
    attn_mask: torch.Tensor | None  # [q, kv] causal mask with the context as prefix


@dataclass(frozen=True)
class _StepPlan:
    page_index: torch.Tensor  # [T] page of each new token
    slot_in_page: torch.Tensor  # [T]
    decode: _DecodePlan | None
    chunks: tuple[_ChunkPlan, ...]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, kv_cache: torch.Tensor, page_size: int, scale: float) -> None:
        super().__init__(kv_cache, page_size, scale)
        self.num_kv_heads = kv_cache.shape[3]
        self._plan: _StepPlan | None = None
        self._plan_batch: AttentionBatch | None = None

    def begin_step(self, batch: AttentionBatch) -> None:
        self._plan = self._build_plan(batch)
        self._plan_batch = batch

    def _build_plan(self, batch: AttentionBatch) -> _StepPlan:
        slots = batch.slot_mapping.to(self.kv_cache.device)
        starts = [0]
        for query_len in batch.query_lens_list:
            starts.append(starts[-1] + query_len)
        decode_seqs = [i for i, n in enumerate(batch.query_lens_list) if n == 1]
        chunks = [
            self._chunk_plan(batch, i, starts[i], starts[i + 1])
            for i, n in enumerate(batch.query_lens_list)
            if n > 1
        ]
        return _StepPlan(
            page_index=torch.div(slots, self.page_size, rounding_mode="floor"),
            slot_in_page=torch.remainder(slots, self.page_size),
            decode=self._decode_plan(batch, decode_seqs, starts) if decode_seqs else None,
            chunks=tuple(chunks),
        )

    def _decode_plan(
        self, batch: AttentionBatch, seqs: list[int], starts: list[int]
    ) -> _DecodePlan:
        device = self.kv_cache.device
        all_decode = len(seqs) == batch.num_seqs
        seq_index = torch.tensor(seqs, dtype=torch.long, device=device)
        seq_lens = batch.seq_lens.to(device)
        table = batch.page_table.to(device)
        if not all_decode:
            seq_lens, table = seq_lens.index_select(0, seq_index), table.index_select(0, seq_index)
        max_len = max(batch.seq_lens_list[i] for i in seqs)
        num_pages = -(-max_len // self.page_size)
        table = table[:, :num_pages]
        # Padding entries (-1) point at the sequence's own first page: always a valid page of
        # this sequence, and masked out below.
        table = torch.where(table >= 0, table, table[:, :1])
        kv_len = num_pages * self.page_size
        positions = torch.arange(kv_len, device=device)
        bias = torch.zeros(len(seqs), 1, kv_len, dtype=self.kv_cache.dtype, device=device)
        bias.masked_fill_((positions[None, :] >= seq_lens[:, None])[:, None, :], float("-inf"))
        key_bias = bias.repeat(self.num_kv_heads, 1, 1)  # batch order (kv head, sequence)
        token_index = None
        if not all_decode:
            token_index = torch.tensor([starts[i] for i in seqs], dtype=torch.long, device=device)
        return _DecodePlan(token_index, table.reshape(-1), len(seqs), kv_len, key_bias)

    def _chunk_plan(self, batch: AttentionBatch, seq: int, start: int, end: int) -> _ChunkPlan:
        seq_len = batch.seq_lens_list[seq]
        context_len = seq_len - (end - start)
        if context_len == 0:
            return _ChunkPlan(start, end, None, None)
        device = self.kv_cache.device
        num_pages = -(-seq_len // self.page_size)
        page_ids = batch.page_table[seq, :num_pages].to(device)
        # Query i sits at absolute position context_len + i and sees keys 0..context_len + i.
        query_pos = torch.arange(context_len, seq_len, device=device)
        key_pos = torch.arange(num_pages * self.page_size, device=device)
        attn_mask = key_pos[None, :] <= query_pos[:, None]
        return _ChunkPlan(start, end, page_ids, attn_mask)

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        if self._plan is None or self._plan_batch is not batch:
            self.begin_step(batch)
        plan = self._plan
        assert plan is not None
        cache = self.kv_cache[layer]  # [pages, 2, kv_heads, page_size, head_dim]
        # Write first: new tokens must attend to themselves (contract in base.py). One indexed
        # store for K and V together.
        new_kv = torch.stack((k, v), dim=1).to(cache.dtype)  # [T, 2, Hk, D]
        cache[plan.page_index, :, :, plan.slot_in_page] = new_kv

        decode = plan.decode
        if decode is not None and decode.token_index is None:
            return self._decode(cache, q, decode)  # a pure decode step: no scatter needed
        out = torch.empty_like(q)
        if decode is not None and decode.token_index is not None:
            rows = decode.token_index
            out[rows] = self._decode(cache, q.index_select(0, rows), decode)
        for chunk in plan.chunks:
            out[chunk.start : chunk.end] = self._chunk(cache, q, k, v, chunk)
        return out

    def _gather(self, cache: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
        """[2, Hk, len(page_ids), P, D]: K and V of the pages, heads outermost, one copy."""
        return cache.permute(1, 2, 0, 3, 4).index_select(2, page_ids)

    def _decode(self, cache: torch.Tensor, q: torch.Tensor, plan: _DecodePlan) -> torch.Tensor:
        """q [Bd, Hq, D] (one token per sequence) -> [Bd, Hq, D]."""
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = self.num_kv_heads
        group = num_heads // num_kv_heads
        kv = self._gather(cache, plan.page_ids).to(q.dtype)
        # Batch (kv head, sequence): each KV head's K is one contiguous [kv_len, D] block.
        keys = kv[0].view(num_kv_heads * num_seqs, plan.kv_len, head_dim)
        values = kv[1].view(num_kv_heads * num_seqs, plan.kv_len, head_dim)
        queries = q.view(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1)
        queries = queries.reshape(num_kv_heads * num_seqs, group, head_dim)
        scores = torch.baddbmm(
            plan.key_bias.to(q.dtype), queries, keys.transpose(1, 2), alpha=self.scale
        )
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.bmm(probs, values)  # [Hk * Bd, group, D]
        return (
            out.view(num_kv_heads, num_seqs, group, head_dim)
            .transpose(0, 1)
            .reshape(num_seqs, num_heads, head_dim)
        )

    def _chunk(
        self,
        cache: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        chunk: _ChunkPlan,
    ) -> torch.Tensor:
        # SDPA takes its fused CPU kernels only for 4-D inputs; 3-D ones fall back to the slow
        # math path, so a batch dimension of 1 is added.
        query = q[chunk.start : chunk.end].transpose(0, 1)  # [Hq, n, D]
        if chunk.page_ids is None:
            keys = k[chunk.start : chunk.end].transpose(0, 1)
            values = v[chunk.start : chunk.end].transpose(0, 1)
            out = F.scaled_dot_product_attention(
                query[None],
                keys[None],
                values[None],
                is_causal=True,
                scale=self.scale,
                enable_gqa=True,
            )[0]
        else:
            kv = self._gather(cache, chunk.page_ids).to(q.dtype)  # [2, Hk, pages, P, D]
            kv = kv.flatten(2, 3)
            out = F.scaled_dot_product_attention(
                query[None],
                kv[0][None],
                kv[1][None],
                attn_mask=chunk.attn_mask,
                scale=self.scale,
                enable_gqa=True,
            )[0]
        return out.transpose(0, 1)
