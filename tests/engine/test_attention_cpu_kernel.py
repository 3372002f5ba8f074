"""The C++ CPU decode-attention kernel (``torch.ops.pdserve.paged_decode_attention``) against
float64 attention over the same pages: head sizes with a compiled fast path (64, 128) and
without (48), GQA groups, page sizes below, at and above one 16-key block, scattered pages,
batches that split work per sequence and per KV head, bfloat16, a latent (single-plane) cache,
and the checks that refuse bad input before reading memory."""

from __future__ import annotations

import pytest
import torch

from workers.engine.attention import cpu_kernel


@pytest.fixture(scope="module")
def kernel() -> cpu_kernel.PagedDecode:
    op = cpu_kernel.paged_decode_attention()
    assert op is not None, cpu_kernel.unavailable_reason()  # `make install` builds it
    return op


def make_case(
    lens: list[int],
    *,
    query_heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    planes: int = 2,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, cache, page_table, seq_lens): pages handed out in a scrambled order, with spare pages
    and -1 padding in the table like the engine's."""
    generator = torch.Generator().manual_seed(seed)
    pages_of = [-(-n // page_size) for n in lens]
    num_pages = sum(pages_of) + 5
    cache = torch.randn(num_pages, planes, kv_heads, page_size, head_dim, generator=generator)
    order = torch.randperm(num_pages, generator=generator)
    table = torch.full((len(lens), max(pages_of) + 2), -1, dtype=torch.long)
    used = 0
    for i, n in enumerate(pages_of):
        table[i, :n] = order[used : used + n]
        used += n
    q = torch.randn(len(lens), query_heads, head_dim, generator=generator)
    return q.to(dtype), cache.to(dtype), table, torch.tensor(lens, dtype=torch.long)


def reference(
    q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """float64 softmax attention of each query row over its sequence's keys (values = the last
    plane: V, or the keys themselves in a single-plane cache)."""
    query_heads = q.shape[1]
    kv_heads = cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, n in enumerate(lens.tolist()):
        pages = table[i, : -(-n // cache.shape[3])]
        # [planes, Hk, pages * P, D] -> the first n tokens
        kv = cache[pages].double().permute(1, 2, 0, 3, 4).flatten(2, 3)[:, :, :n]
        keys = kv[0].repeat_interleave(query_heads // kv_heads, 0)
        values = kv[-1].repeat_interleave(query_heads // kv_heads, 0)
        scores = torch.einsum("hd,hnd->hn", q[i].double(), keys) * scale
        out[i] = torch.einsum("hn,hnd->hd", scores.softmax(-1), values)
    return out


SHAPES = {
    # (query heads, kv heads, head_dim, page size)
    "gqa3-d64-p16": (9, 3, 64, 16),  # SmolLM2's attention
    "mha-d128-p16": (4, 4, 128, 16),
    "gqa4-d48-p16": (8, 2, 48, 16),  # no compiled head size: the generic loops
    "gqa2-d64-p8": (4, 2, 64, 8),  # pages shorter than one 16-key block
    "gqa2-d64-p32": (4, 2, 64, 32),  # two 16-key blocks per page
    # groups past one pass's registers (4 heads at 64, 2 at 128): passes of 4 + 4, 4 + 1, 2 + 1
    "gqa8-d64-p16": (16, 2, 64, 16),
    "gqa5-d64-p16": (10, 2, 64, 16),
    "gqa3-d128-p16": (6, 2, 128, 16),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("batch", ["few", "many"])
def test_matches_float64_attention(kernel: cpu_kernel.PagedDecode, shape: str, batch: str) -> None:
    """``few``: fewer sequences than 4 per thread, one task per (sequence, KV head); ``many``:
    one task per sequence, reading each page's heads in one pass."""
    query_heads, kv_heads, head_dim, page_size = SHAPES[shape]
    lens = [1, 15, 16, 17, 300, 33] if batch == "few" else [(37 * i) % 290 + 1 for i in range(40)]
    q, cache, table, seq_lens = make_case(
        lens, query_heads=query_heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size
    )
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    kernel(out, q, cache, table, seq_lens, 1, scale)
    torch.testing.assert_close(
        out.double(), reference(q, cache, table, seq_lens, scale), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("head_dim", [64, 128, 48])
def test_bfloat16_reads_and_writes_bfloat16(kernel: cpu_kernel.PagedDecode, head_dim: int) -> None:
    """The compiled head sizes split each 32 bfloat16 values into even and odd lanes; the output
    must come back in the row's own order."""
    q, cache, table, lens = make_case(
        [5, 200, 64, 129],
        query_heads=9,
        kv_heads=3,
        head_dim=head_dim,
        page_size=16,
        dtype=torch.bfloat16,
    )
    out = torch.empty_like(q)
    kernel(out, q, cache, table, lens, 1, 0.125)
    assert out.dtype == torch.bfloat16
    # float32 arithmetic inside: off from float64 by the output's bfloat16 rounding only.
    expected = reference(q, cache, table, lens, 0.125)
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("head_dim", [96, 64])
def test_latent_cache_uses_keys_as_values(kernel: cpu_kernel.PagedDecode, head_dim: int) -> None:
    q, cache, table, lens = make_case(
        [3, 70, 31], query_heads=8, kv_heads=1, head_dim=head_dim, page_size=16, planes=1
    )
    out = torch.empty_like(q)
    kernel(out, q, cache, table, lens, 0, 0.1)
    torch.testing.assert_close(
        out.double(), reference(q, cache, table, lens, 0.1), atol=1e-5, rtol=1e-5
    )


def test_query_may_be_a_strided_view(kernel: cpu_kernel.PagedDecode) -> None:
    """The engine passes q as a slice of the fused q|k|v projection."""
    q, cache, table, lens = make_case([40, 9], query_heads=6, kv_heads=2, head_dim=64, page_size=16)
    fused = torch.cat([q, torch.randn(2, 4, 64)], dim=1)  # [B, Hq + 2 Hk, D]
    view = fused[:, :6]
    assert not view.is_contiguous()
    out = torch.empty_like(q)
    kernel(out, view, cache, table, lens, 1, 0.125)
    torch.testing.assert_close(
        out.double(), reference(q, cache, table, lens, 0.125), atol=1e-5, rtol=1e-5
    )


def test_bad_input_is_refused_before_reading(kernel: cpu_kernel.PagedDecode) -> None:
    q, cache, table, lens = make_case(
        [20, 40], query_heads=4, kv_heads=2, head_dim=64, page_size=16
    )
    out = torch.empty_like(q)
    bad = table.clone()
    bad[1, 1] = cache.shape[0]  # one past the pool
    with pytest.raises(RuntimeError, match="outside the cache's"):
        kernel(out, q, cache, bad, lens, 1, 0.125)
    with pytest.raises(RuntimeError, match="does not fit its page-table row"):
        kernel(out, q, cache, table, torch.tensor([20, 16 * table.shape[1] + 1]), 1, 0.125)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernel(out, q.double(), cache, table, lens, 1, 0.125)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        kernel(out.half(), q.half(), cache.half(), table, lens, 1, 0.125)
    with pytest.raises(RuntimeError, match="int64"):
        kernel(out, q, cache, table.int(), lens, 1, 0.125)
