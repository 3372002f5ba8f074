"""The C++ CPU prefill-attention kernel (``torch.ops.pdserve.paged_prefill_attention``) against
float64 causal attention over the same pages: whole prompts and chunks after cached context,
several sequences in one call with rows of other tokens between them, head sizes with a compiled
fast path (64, 128) and without (48, 96), GQA groups, page sizes below, at and above one 16-key
tile, bfloat16, a latent (single-plane) cache, a strided q, and the checks that refuse bad input
before reading memory."""

from __future__ import annotations

import pytest
import torch

from workers.engine.attention import cpu_kernel


@pytest.fixture(scope="module")
def kernel() -> cpu_kernel.PagedPrefill:
    op = cpu_kernel.paged_prefill_attention()
    assert op is not None, cpu_kernel.unavailable_reason()  # `make install` builds it
    return op


def make_case(
    seqs: list[tuple[int, int]],
    *,
    query_heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    planes: int = 2,
    dtype: torch.dtype = torch.float32,
    gap: int = 0,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, cache, page_table, query_starts, query_lens, seq_lens) for sequences of (cached
    context, new tokens): pages handed out in a scrambled order, spare pages and -1 padding in
    the table like the engine's, and ``gap`` rows of q (other tokens of the step) before each
    sequence's new tokens."""
    generator = torch.Generator().manual_seed(seed)
    lens = [context + new for context, new in seqs]
    pages_of = [-(-n // page_size) for n in lens]
    num_pages = sum(pages_of) + 5
    cache = torch.randn(num_pages, planes, kv_heads, page_size, head_dim, generator=generator)
    order = torch.randperm(num_pages, generator=generator)
    table = torch.full((len(seqs), max(pages_of) + 2), -1, dtype=torch.long)
    used = 0
    for i, n in enumerate(pages_of):
        table[i, :n] = order[used : used + n]
        used += n
    starts, row = [], 0
    for _, new in seqs:
        row += gap
        starts.append(row)
        row += new
    q = torch.randn(row, query_heads, head_dim, generator=generator)
    return (
        q.to(dtype),
        cache.to(dtype),
        table,
        torch.tensor(starts, dtype=torch.long),
        torch.tensor([new for _, new in seqs], dtype=torch.long),
        torch.tensor(lens, dtype=torch.long),
    )


def reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    table: torch.Tensor,
    starts: torch.Tensor,
    query_lens: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    magnitudes: bool = False,
) -> dict[int, torch.Tensor]:
    """Row of q -> float64 causal attention of that token (values = the last plane: V, or the
    keys themselves in a single-plane cache); ``magnitudes``: the same weights over |V|."""
    query_heads, kv_heads, page_size = q.shape[1], cache.shape[2], cache.shape[3]
    rows: dict[int, torch.Tensor] = {}
    per_seq = zip(starts.tolist(), query_lens.tolist(), lens.tolist(), strict=True)
    for i, (start, new, n) in enumerate(per_seq):
        pages = table[i, : -(-n // page_size)]
        kv = cache[pages].double().permute(1, 2, 0, 3, 4).flatten(2, 3)[:, :, :n]
        keys = kv[0].repeat_interleave(query_heads // kv_heads, 0)
        values = kv[-1].repeat_interleave(query_heads // kv_heads, 0)
        if magnitudes:
            values = values.abs()
        for j in range(new):
            seen = n - new + j + 1  # the token at position n - new + j sees itself and before
            scores = torch.einsum("hd,hnd->hn", q[start + j].double(), keys[:, :seen]) * scale
            rows[start + j] = torch.einsum("hn,hnd->hd", scores.softmax(-1), values[:, :seen])
    return rows


def check(out: torch.Tensor, expected: dict[int, torch.Tensor], tolerance: float) -> None:
    for row, value in expected.items():
        torch.testing.assert_close(out[row].double(), value, atol=tolerance, rtol=tolerance)


SHAPES = {
    # (query heads, kv heads, head_dim, page size)
    "gqa3-d64-p16": (9, 3, 64, 16),  # SmolLM2's attention
    "mha-d128-p16": (4, 4, 128, 16),
    "gqa4-d48-p16": (8, 2, 48, 16),  # no compiled head size, not a multiple of 32
    "gqa2-d64-p8": (4, 2, 64, 8),  # a 16-key tile spans two pages
    "gqa2-d64-p32": (4, 2, 64, 32),  # two tiles per page
}

# (cached context, new tokens): whole prompts of 1, 15, 16, 17 and 70 tokens, chunks after
# context that starts mid-tile and mid-page, a verify-like 4-token step after a long context.
SEQUENCES = [(0, 70), (0, 1), (0, 15), (0, 16), (0, 17), (23, 40), (48, 33), (200, 4)]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_matches_float64_causal_attention(kernel: cpu_kernel.PagedPrefill, shape: str) -> None:
    query_heads, kv_heads, head_dim, page_size = SHAPES[shape]
    q, cache, table, starts, query_lens, lens = make_case(
        SEQUENCES,
        query_heads=query_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        gap=2,
    )
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    kernel(out, q, cache, table, starts, query_lens, lens, 1, scale)
    expected = reference(q, cache, table, starts, query_lens, lens, scale)
    check(out, expected, 1e-5)
    # Rows of other tokens are left as they were.
    others = sorted(set(range(q.shape[0])) - set(expected))
    assert others and out[others].isnan().all()


@pytest.mark.parametrize("head_dim", [64, 96])  # value sums 64 or 16 columns at a time
def test_bfloat16_reads_and_writes_bfloat16(kernel: cpu_kernel.PagedPrefill, head_dim: int) -> None:
    q, cache, table, starts, query_lens, lens = make_case(
        [(0, 50), (37, 20)],
        query_heads=9,
        kv_heads=3,
        head_dim=head_dim,
        page_size=16,
        dtype=torch.bfloat16,
    )
    out = torch.empty_like(q)
    kernel(out, q, cache, table, starts, query_lens, lens, 1, 0.125)
    assert out.dtype == torch.bfloat16
    # float32 sums inside: off from float64 by bfloat16 roundings only, each at most 2^-8 of
    # what it rounds: the output's, and on CPUs with AVX512_BF16 the softmax weights' before
    # they scale the values (at most 2^-8 of sum(weight * |V|) in all).
    expected = reference(q, cache, table, starts, query_lens, lens, 0.125)
    magnitudes = reference(q, cache, table, starts, query_lens, lens, 0.125, magnitudes=True)
    for row, value in expected.items():
        bound = (value.abs() + magnitudes[row]) * 2.0**-8 * 1.01  # 1%: the float32 sums
        assert ((out[row].double() - value).abs() <= bound).all(), row


def test_latent_cache_uses_keys_as_values(kernel: cpu_kernel.PagedPrefill) -> None:
    q, cache, table, starts, query_lens, lens = make_case(
        [(0, 30), (20, 9)], query_heads=8, kv_heads=1, head_dim=96, page_size=16, planes=1
    )
    out = torch.empty_like(q)
    kernel(out, q, cache, table, starts, query_lens, lens, 0, 0.1)
    check(out, reference(q, cache, table, starts, query_lens, lens, 0.1), 1e-5)


def test_query_may_be_a_strided_view(kernel: cpu_kernel.PagedPrefill) -> None:
    """The engine passes q as a slice of the fused q|k|v projection."""
    q, cache, table, starts, query_lens, lens = make_case(
        [(0, 21), (5, 7)], query_heads=6, kv_heads=2, head_dim=64, page_size=16
    )
    fused = torch.cat([q, torch.randn(q.shape[0], 4, 64)], dim=1)  # [T, Hq + 2 Hk, D]
    view = fused[:, :6]
    assert not view.is_contiguous()
    out = torch.empty_like(q)
    kernel(out, view, cache, table, starts, query_lens, lens, 1, 0.125)
    check(out, reference(q, cache, table, starts, query_lens, lens, 0.125), 1e-5)


def test_more_threads_than_tasks_and_one_thread(kernel: cpu_kernel.PagedPrefill) -> None:
    """One task (a single token, one KV head) and many, on one thread and on several: the shared
    task counter hands each task out exactly once."""
    for threads in (1, 4):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for seqs in ([(9, 1)], [(0, 100), (3, 50)]):
                q, cache, table, starts, query_lens, lens = make_case(
                    seqs, query_heads=2, kv_heads=1, head_dim=64, page_size=16
                )
                out = torch.full_like(q, float("nan"))
                kernel(out, q, cache, table, starts, query_lens, lens, 1, 0.125)
                check(out, reference(q, cache, table, starts, query_lens, lens, 0.125), 1e-5)
        finally:
            torch.set_num_threads(previous)


def test_bad_input_is_refused_before_reading(kernel: cpu_kernel.PagedPrefill) -> None:
    q, cache, table, starts, query_lens, lens = make_case(
        [(0, 20), (10, 30)], query_heads=4, kv_heads=2, head_dim=64, page_size=16
    )
    out = torch.empty_like(q)

    def call(**changes: object) -> None:
        args = {
            "table": table,
            "starts": starts,
            "query_lens": query_lens,
            "lens": lens,
            "q": q,
            "cache": cache,
        }
        args.update(changes)
        kernel(
            out,
            args["q"],
            args["cache"],
            args["table"],
            args["starts"],
            args["query_lens"],
            args["lens"],
            1,
            0.125,
        )

    bad_page = table.clone()
    bad_page[1, 0] = cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        call(table=bad_page)
    with pytest.raises(RuntimeError, match="does not fit its page-table row"):
        call(lens=torch.tensor([20, 16 * table.shape[1] + 1]))
    with pytest.raises(RuntimeError, match="do not fit q"):
        call(starts=torch.tensor([0, q.shape[0] - 10]))
    with pytest.raises(RuntimeError, match="do not fit q"):
        call(query_lens=torch.tensor([20, 41]))  # more new tokens than the sequence has
    with pytest.raises(RuntimeError, match="must be int64"):
        call(starts=starts.int())
    with pytest.raises(RuntimeError, match="multiple of 16"):
        narrow = q[:, :, :40].contiguous()
        kernel(
            torch.empty_like(narrow),
            narrow,
            cache[..., :40].contiguous(),
            table,
            starts,
            query_lens,
            lens,
            1,
            0.125,
        )
    with pytest.raises(RuntimeError, match="share a dtype"):
        call(q=q.double())
