"""Shared cases for attention backend tests: a mixed batch and a dense float64 reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.engine.attention import AttentionBatch


@dataclass
class MixedCase:
    kv_cache: torch.Tensor
    batch: AttentionBatch
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor  # latent cases: k itself (the backend is given None)
    # Per sequence: full K and V [seq_len, Hk, D] (cached context + new tokens), for the reference.
    full_k: list[torch.Tensor]
    full_v: list[torch.Tensor]
    used_pages: set[int]


def make_mixed_case(
    context_lens: list[int],
    query_lens: list[int],
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    page_size: int = 16,
    num_pages: int = 48,
    num_layers: int = 2,
    layer: int = 1,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    latent: bool = False,
) -> MixedCase:
    """Sequences with ``context_lens[i]`` tokens already cached (written straight into the cache)
    and ``query_lens[i]`` new tokens; pages are handed out in a scrambled order.

    ``latent``: a single-plane cache (MLA), whose one row per token is its key and its value."""
    gen = torch.Generator().manual_seed(seed)
    planes = 1 if latent else 2
    cache = torch.randn(
        num_layers, num_pages, planes, num_kv_heads, page_size, head_dim, generator=gen
    )
    free = torch.randperm(num_pages, generator=gen).tolist()
    tables: list[list[int]] = []
    full_k: list[torch.Tensor] = []
    full_v: list[torch.Tensor] = []
    slots: list[int] = []
    new_k: list[torch.Tensor] = []
    new_v: list[torch.Tensor] = []
    for context, new in zip(context_lens, query_lens, strict=True):
        total = context + new
        pages = [free.pop() for _ in range(-(-total // page_size))]
        tables.append(pages)
        seq_k = torch.randn(total, num_kv_heads, head_dim, generator=gen)
        seq_v = seq_k if latent else torch.randn(total, num_kv_heads, head_dim, generator=gen)
        for pos in range(total):
            page, offset = pages[pos // page_size], pos % page_size
            if pos < context:
                cache[layer, page, 0, :, offset] = seq_k[pos]
                if not latent:
                    cache[layer, page, 1, :, offset] = seq_v[pos]
            else:
                slots.append(page * page_size + offset)
        full_k.append(seq_k)
        full_v.append(seq_v)
        new_k.append(seq_k[context:])
        new_v.append(seq_v[context:])
    max_pages = max(len(t) for t in tables)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens, strict=True)]
    batch = AttentionBatch(
        query_start_loc=torch.tensor(starts, device=device),
        seq_lens=torch.tensor(seq_lens, device=device),
        context_lens=torch.tensor(context_lens, device=device),
        page_table=torch.tensor([t + [-1] * (max_pages - len(t)) for t in tables], device=device),
        slot_mapping=torch.tensor(slots, device=device),
        query_lens_list=tuple(query_lens),
        seq_lens_list=tuple(seq_lens),
    )
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    return MixedCase(
        kv_cache=cache.to(device=device, dtype=dtype),
        batch=batch,
        q=q.to(device=device, dtype=dtype),
        k=torch.cat(new_k).to(device=device, dtype=dtype),
        v=torch.cat(new_v).to(device=device, dtype=dtype),
        full_k=full_k,
        full_v=full_v,
        used_pages={p for t in tables for p in t},
    )


def reference_attention(case: MixedCase, scale: float) -> torch.Tensor:
    """Dense causal attention per sequence in float64 (the new tokens are the last rows)."""
    outputs = []
    q = case.q.double().cpu()
    group = q.shape[1] // case.full_k[0].shape[1]
    for i, (start, n) in enumerate(
        zip(case.batch.query_start_loc.tolist(), case.batch.query_lens_list, strict=False)
    ):
        keys = case.full_k[i].double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        values = case.full_v[i].double().repeat_interleave(group, dim=1)
        total = keys.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q[start : start + n], keys) * scale
        query_pos = torch.arange(total - n, total)[:, None]
        mask = torch.arange(total)[None, :] <= query_pos
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        outputs.append(torch.einsum("hqk,khd->qhd", probs, values))
    return torch.cat(outputs)
