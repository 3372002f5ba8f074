"""PyTorch attention over the paged HND cache (CPU and any device; the reference backend), with
C++ decode and prefill kernels of our own for CPU caches.

Per step (`begin_step`) the batch is split once into
- *decode* sequences (one new token). Three ways to attend them:
  - *kernel* (the default for a contiguous float32 or bfloat16 CPU cache on an AVX-512 CPU,
    when built; `cpu_kernel.preferred`): our C++ operator (`cpu_kernel`, source in
    `csrc/paged_decode.cpp`) reads each sequence's pages where they lie, each K/V row once for
    all query heads of its KV head, with an online softmax per query head, on torch's intra-op
    threads. Measured on a 2-vCPU AMD EPYC (`bench/engine.py --attention`, contexts of 48-1200
    tokens): 0.44-0.60x the time of the sparse path in float32 and 0.25-0.33x that of the
    gather path in bfloat16;
  - *sparse* (float32 CPU caches without the kernel): nothing is gathered. Scores are a
    sampled matmul (``torch.sparse.sampled_addmm``) of the queries with the cache's K rows
    listed in a per-step CSR pattern, and the output is a weighted sum of the cache's V rows
    (``F.embedding_bag`` with the probabilities as per-row weights): K and V are read once from
    where they lie, never copied. On CPU this was 1.25-1.9x faster per layer than gathering
    pages and calling SDPA (batch 8-32, 48-1200 tokens), float32 results within 1e-6 of it.
    The softmax is one dense call when every row has as many entries: equal lengths, or
    lengths close enough (`_PADDED_SOFTMAX_SLACK`) that shorter rows are padded with a masked
    repeat of their first key; otherwise a segmented softmax over rows of their own lengths;
  - *gather* (other devices and dtypes, or without the kernel): sequences sorted by length are
    cut into groups of similar length and bounded size; per layer each group's pages are
    gathered with one ``index_select`` into a reused buffer and attended by one 4-D
    ``scaled_dot_product_attention`` call (the fused flash kernel). Keys past a sequence's length
    are masked only in groups whose lengths differ;
- *chunk* sequences (several new tokens: prefill chunks, a whole prompt, a verify step's
  drafts). Two ways:
  - *kernel* (the default for a contiguous float32 or bfloat16 CPU cache with a head size that
    is a multiple of 16 on an AVX-512 CPU, when built, but for a bfloat16 cache on a CPU with
    AMX tiles, where SDPA's own kernel uses them: `cpu_kernel.prefill_preferred`): our C++ operator
    (`csrc/paged_prefill.cpp`) attends every chunk sequence of the step in one call,
    causally, reading the sequence's keys and values from the cache where they lie (the new
    tokens' K/V are stored first). Measured on the same VM (`bench/engine.py --attention`,
    prompts of 256-1800 tokens and 256 after 1024 cached): 0.43-0.82x the time of SDPA below;
  - *SDPA*: one ``scaled_dot_product_attention`` call each, causal with the cached context as
    prefix. A chunk without cached context attends over its own new K/V directly, without
    touching the cache.
GQA is handled by grouping query heads per KV head, never by copying K/V per query head.

A single-plane cache (``kv_cache.shape[2] == 1``, MLA's latent) puts the backend in *latent
mode*: each token's one cached row serves as its key and as its value (MQA with V = K), so every
path reads plane 0 twice instead of planes 0 and 1, and only the keys are stored.

Why groups: padding every decode sequence to the longest of the batch copies and attends over
padding (about half the work with contexts of 100-1200 tokens), while one kernel call per
sequence costs ~10-20 us each; similar lengths share a call, with padding bounded per sequence
(`_BUCKET_SLACK_PAGES`, `_BUCKET_SLACK_FRACTION`). Bounding a group's bytes
(`_GATHER_GROUP_BYTES`) lets attention read the gathered pages from the CPU cache.

Why a reused gather buffer: a freshly allocated multi-MB tensor is page-faulted in on every
gather (glibc hands large blocks back to the OS), which on CPU cost more than the copy itself.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.engine.attention import cpu_kernel
from workers.engine.attention.base import AttentionBackend, AttentionBatch

# A decode sequence joins the current bucket (led by its longest sequence, ``n`` pages) when it
# is at most max(_BUCKET_SLACK_PAGES, n // _BUCKET_SLACK_FRACTION) pages shorter: padding is
# bounded to ~1/8 of a bucket's work, and short sequences never split over a few pages.
_BUCKET_SLACK_PAGES = 4
_BUCKET_SLACK_FRACTION = 8
# A bucket is split into groups of at most this many bytes of gathered K/V (at least one
# sequence each), so attention reads a group's pages while they are still in the CPU cache. On
# the 2-vCPU Xeon VM of bench/history/RESULTS-notebook.md, batch 32 x 800 tokens: one 52 MB gather per layer was
# ~25 % slower than 2-16 MB groups (which measured within noise of each other).
_GATHER_GROUP_BYTES = 8 << 20
# The sparse decode path pads every row to the batch's longest sequence (one dense, masked
# softmax) while that adds at most this factor of entries over the unpadded total; beyond it,
# a segmented softmax over rows of their own lengths.
_PADDED_SOFTMAX_SLACK = 1.5

# The sparse path only uses CSR construction and `sampled_addmm`; torch warns once per process
# that CSR support is "beta". A module-level filter (not `catch_warnings`, which swaps the
# process-wide filters and is not thread-safe) keeps that out of the workers' logs.
warnings.filterwarnings(
    "ignore", message="Sparse CSR tensor support is in beta", category=UserWarning
)


@dataclass(frozen=True)
class _DecodeGroup:
    """Decode sequences attended by one kernel call over one gather of their pages."""

    start: int  # first row of the group in the (sorted) decode order
    end: int
    page_ids: torch.Tensor  # [n * num_pages] pages to gather, sequence after sequence
    num_pages: int  # pages per sequence (the group's longest; shorter ones are padded)
    kv_len: int  # keys attended: the group's longest sequence
    attn_mask: torch.Tensor | None  # [n, 1, 1, kv_len] bool, True = attend; None if all equal


@dataclass(frozen=True)
class _SparseDecode:
    """Decode attention read straight from the cache (CPU float32, see `_decode_sparse`).

    Row r = (sequence, query head) of the decode queries; its entries are the cache rows (of the
    layer's cache viewed as [pages * planes * Hk * P, D]) of that sequence's keys, in token
    order."""

    pattern: torch.Tensor  # sparse CSR [Bd * Hq, cache rows] of the keys' rows (values unused)
    value_rows: torch.Tensor  # [nnz] the matching V rows (the key rows themselves in latent mode)
    offsets: torch.Tensor  # [Bd * Hq] first entry of each row
    row_lens: torch.Tensor  # [Bd * Hq] entries per row
    # Entries per row when every row has as many (a dense softmax over [rows, width]), else None
    # (a segmented softmax over `row_lens`).
    width: int | None
    # [Bd * Hq, width] True for padding entries (a shorter sequence's row padded to the longest:
    # they repeat its first key and are masked out of the softmax); None without padding.
    padding: torch.Tensor | None


@dataclass(frozen=True)
class _DecodePlan:
    # [Bd] rows of q (and of the output) in group order; None when that is 0..T-1 (then every
    # row of the step decodes).
    row_index: torch.Tensor | None
    groups: tuple[_DecodeGroup, ...]  # empty for the sparse path
    # The decode sequences (batch order) when the sparse path attends them; its structure needs
    # the query head count, so the first layer builds it (`_sparse_structure`).
    sparse_seqs: tuple[int, ...] | None = None
    # For the kernel: [Bd, pages] page-table rows and [Bd] lengths of the decode sequences, in
    # batch order (int64, contiguous).
    kernel_pages: torch.Tensor | None = None
    kernel_lens: torch.Tensor | None = None


@dataclass(frozen=True)
class _ChunkPlan:
    start: int  # first row of the sequence's new tokens
    end: int
    page_ids: torch.Tensor | None  # [pages] the sequence's pages, None without cached context
    attn_mask: torch.Tensor | None  # [q, kv] causal mask with the context as prefix


@dataclass(frozen=True)
class _KernelChunks:
    """The step's chunk sequences for the prefill kernel (int64, contiguous, batch order)."""

    page_table: torch.Tensor  # [S, pages]
    query_starts: torch.Tensor  # [S] first row of each sequence's new tokens
    query_lens: torch.Tensor  # [S]
    seq_lens: torch.Tensor  # [S]


@dataclass(frozen=True)
class _StepPlan:
    # Per plane (K, V; the latent alone in latent mode), [T, Hk] rows of the layer's cache viewed
    # as [pages * planes * Hk * P, D] where each new token's row goes; None when the cache is
    # not contiguous (indexed store instead).
    store_rows: tuple[torch.Tensor, ...] | None
    page_index: torch.Tensor  # [T] page of each new token
    slot_in_page: torch.Tensor  # [T]
    decode: _DecodePlan | None
    chunks: tuple[_ChunkPlan, ...]  # attended by SDPA, one call each
    kernel_chunks: _KernelChunks | None  # attended by the prefill kernel, one call for all


def _check_kernel_request(
    requested: bool | None, which: str, fits: bool, kernel: object | None
) -> None:
    """Raises when a kernel was asked for (True) where it cannot run."""
    if not requested:
        return
    if not fits:
        raise ValueError(
            f"the CPU {which}-attention kernel takes a contiguous float32 or bfloat16 CPU cache"
            + (" with a head size that is a multiple of 16" if which == "prefill" else "")
        )
    if kernel is None:
        raise ValueError(
            f"the CPU {which}-attention kernel cannot run here: " + cpu_kernel.unavailable_reason()
        )


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(
        self,
        kv_cache: torch.Tensor,
        page_size: int,
        scale: float,
        *,
        gather_group_bytes: int = _GATHER_GROUP_BYTES,
        sparse_decode: bool | None = None,
        decode_kernel: bool | None = None,
        prefill_kernel: bool | None = None,
    ) -> None:
        """``decode_kernel``: attend decode tokens with the C++ kernel (`cpu_kernel`); None picks
        it for a contiguous float32 or bfloat16 CPU cache on an AVX-512 CPU when the kernel is
        built (`cpu_kernel.preferred`); True where it cannot run raises. ``prefill_kernel``: the same for chunk tokens (the prefill kernel
        also needs a head size that is a multiple of 16); without it, SDPA. Without the decode
        kernel, ``sparse_decode``: read decode K/V straight from the cache (`_decode_sparse`)
        instead of gathering pages; None picks it for a contiguous float32 CPU cache, where it
        was measured faster than gathering; it needs a contiguous cache.

        The cache's plane axis (``kv_cache.shape[2]``) picks the mode: 2 (K and V) or 1 (latent
        mode, see the module docstring)."""
        super().__init__(kv_cache, page_size, scale)
        self.kv_planes = kv_cache.shape[2]
        if self.kv_planes not in (1, 2):
            raise ValueError(f"KV cache needs 1 or 2 planes, got {self.kv_planes}")
        self.latent = self.kv_planes == 1
        # The plane values are read from: V's, or in latent mode the keys' own.
        self._value_plane = self.kv_planes - 1
        self.num_kv_heads = kv_cache.shape[3]
        self.gather_group_bytes = gather_group_bytes
        kernel_fits = (
            kv_cache.device.type == "cpu"
            and kv_cache.dtype in (torch.float32, torch.bfloat16)
            and kv_cache.is_contiguous()
        )
        # None: the kernels where they were measured faster (`cpu_kernel.preferred`).
        preferred = cpu_kernel.preferred()
        wanted = kernel_fits and (decode_kernel or (decode_kernel is None and preferred))
        self._kernel = cpu_kernel.paged_decode_attention() if wanted else None
        _check_kernel_request(decode_kernel, "decode", kernel_fits, self._kernel)
        self.decode_kernel = self._kernel is not None
        prefill_fits = kernel_fits and kv_cache.shape[-1] % 16 == 0
        # Not for half precision on AMX, where SDPA computes on the tiles.
        prefill_preferred = cpu_kernel.prefill_preferred(kv_cache.dtype)
        wanted = prefill_fits and (prefill_kernel or (prefill_kernel is None and prefill_preferred))
        self._prefill_kernel = cpu_kernel.paged_prefill_attention() if wanted else None
        _check_kernel_request(prefill_kernel, "prefill", prefill_fits, self._prefill_kernel)
        self.prefill_kernel = self._prefill_kernel is not None
        if sparse_decode is None:
            sparse_decode = kv_cache.device.type == "cpu" and kv_cache.dtype == torch.float32
        self.sparse_decode = sparse_decode and kv_cache.is_contiguous() and not self.decode_kernel
        self._plan: _StepPlan | None = None
        self._plan_batch: AttentionBatch | None = None
        self._sparse: _SparseDecode | None = None  # the step's sparse structure, once built
        # Flat storage the page gathers write into, grown on demand and reused by every layer
        # and step (see the module docstring).
        self._gather_buffer = torch.empty(0, dtype=kv_cache.dtype, device=kv_cache.device)

    def begin_step(self, batch: AttentionBatch) -> None:
        self._plan = self._build_plan(batch)
        self._plan_batch = batch
        self._sparse = None

    def _build_plan(self, batch: AttentionBatch) -> _StepPlan:
        slots = batch.slot_mapping.to(self.kv_cache.device)
        page_index = torch.div(slots, self.page_size, rounding_mode="floor")
        slot_in_page = torch.remainder(slots, self.page_size)
        store_rows = None
        if self.kv_cache.is_contiguous():
            heads = torch.arange(self.num_kv_heads, device=slots.device)
            # Row of (page, plane 0, head, slot) in [pages, planes, Hk, P] order; plane p's is
            # p * Hk * P further.
            k_rows = (
                page_index[:, None] * (self.kv_planes * self.num_kv_heads) + heads[None, :]
            ) * self.page_size + slot_in_page[:, None]
            plane_rows = self.num_kv_heads * self.page_size
            store_rows = tuple(k_rows + plane * plane_rows for plane in range(self.kv_planes))
        starts = [0]
        for query_len in batch.query_lens_list:
            starts.append(starts[-1] + query_len)
        decode_seqs = [i for i, n in enumerate(batch.query_lens_list) if n == 1]
        chunk_seqs = [i for i, n in enumerate(batch.query_lens_list) if n > 1]
        kernel_chunks = None
        chunks: tuple[_ChunkPlan, ...] = ()
        if chunk_seqs and self.prefill_kernel:
            kernel_chunks = self._kernel_chunks(batch, chunk_seqs, starts)
        else:
            chunks = tuple(self._chunk_plan(batch, i, starts[i], starts[i + 1]) for i in chunk_seqs)
        return _StepPlan(
            store_rows=store_rows,
            page_index=page_index,
            slot_in_page=slot_in_page,
            decode=self._decode_plan(batch, decode_seqs, starts) if decode_seqs else None,
            chunks=chunks,
            kernel_chunks=kernel_chunks,
        )

    def _kernel_chunks(
        self, batch: AttentionBatch, seqs: list[int], starts: list[int]
    ) -> _KernelChunks:
        device = self.kv_cache.device
        table, lens = self._kernel_rows(batch, seqs)
        return _KernelChunks(
            page_table=table,
            query_starts=torch.tensor([starts[i] for i in seqs], dtype=torch.long, device=device),
            query_lens=torch.tensor(
                [batch.query_lens_list[i] for i in seqs], dtype=torch.long, device=device
            ),
            seq_lens=lens,
        )

    def _kernel_rows(
        self, batch: AttentionBatch, seqs: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Page-table rows and lengths of ``seqs`` for the kernels (int64, contiguous)."""
        table = batch.page_table.to(self.kv_cache.device, torch.long)
        lens = batch.seq_lens.to(self.kv_cache.device, torch.long)
        if len(seqs) != batch.num_seqs:
            index = torch.tensor(seqs, dtype=torch.long, device=table.device)
            table, lens = table.index_select(0, index), lens.index_select(0, index)
        return table.contiguous(), lens.contiguous()

    def _decode_plan(
        self, batch: AttentionBatch, seqs: list[int], starts: list[int]
    ) -> _DecodePlan:
        if self.decode_kernel:
            return self._kernel_decode_plan(batch, seqs, starts)
        if self.sparse_decode:
            return self._sparse_decode_plan(seqs, starts)
        device = self.kv_cache.device
        page_size = self.page_size
        lens = {i: batch.seq_lens_list[i] for i in seqs}
        pages_of = {i: -(-lens[i] // page_size) for i in seqs}
        # Longest first (stable, so equal lengths keep their batch order).
        order = sorted(seqs, key=lambda i: -lens[i])
        table = batch.page_table.tolist()
        cache = self.kv_cache
        page_bytes = cache[0, 0].numel() * cache.element_size()
        groups: list[_DecodeGroup] = []
        first = 0
        while first < len(order):
            # A bucket: the longest remaining sequence and those at most `slack` pages shorter.
            num_pages = pages_of[order[first]]
            slack = max(_BUCKET_SLACK_PAGES, num_pages // _BUCKET_SLACK_FRACTION)
            limit = first + max(1, self.gather_group_bytes // (num_pages * page_bytes))
            end = first + 1
            while end < min(len(order), limit) and num_pages - pages_of[order[end]] <= slack:
                end += 1
            members = order[first:end]
            page_ids: list[int] = []
            for i in members:
                pages = table[i][: pages_of[i]]
                # Padding pages repeat the sequence's own first page: valid, and masked out.
                page_ids.extend(pages + [pages[0]] * (num_pages - pages_of[i]))
            max_len = lens[members[0]]
            attn_mask = None
            if any(lens[i] != max_len for i in members):
                member_lens = torch.tensor([lens[i] for i in members], device=device)
                positions = torch.arange(max_len, device=device)
                attn_mask = (positions[None, :] < member_lens[:, None])[:, None, None, :]
            groups.append(
                _DecodeGroup(
                    start=first,
                    end=end,
                    page_ids=torch.tensor(page_ids, dtype=torch.long, device=device),
                    num_pages=num_pages,
                    kv_len=max_len,
                    attn_mask=attn_mask,
                )
            )
            first = end
        return _DecodePlan(row_index=self._row_index(order, starts), groups=tuple(groups))

    def _kernel_decode_plan(
        self, batch: AttentionBatch, seqs: list[int], starts: list[int]
    ) -> _DecodePlan:
        table, lens = self._kernel_rows(batch, seqs)
        return _DecodePlan(
            row_index=self._row_index(seqs, starts),
            groups=(),
            kernel_pages=table,
            kernel_lens=lens,
        )

    def _sparse_decode_plan(self, seqs: list[int], starts: list[int]) -> _DecodePlan:
        return _DecodePlan(
            row_index=self._row_index(seqs, starts), groups=(), sparse_seqs=tuple(seqs)
        )

    def _row_index(self, seqs: list[int], starts: list[int]) -> torch.Tensor | None:
        """The q rows of ``seqs`` in that order; None when they are every row of the step, in
        order (`_DecodePlan.row_index`)."""
        rows = [starts[i] for i in seqs]
        if rows == list(range(starts[-1])):
            return None
        return torch.tensor(rows, dtype=torch.long, device=self.kv_cache.device)

    def _sparse_structure(
        self, batch: AttentionBatch, seqs: tuple[int, ...], num_heads: int
    ) -> _SparseDecode:
        device = self.kv_cache.device
        page_size, num_kv_heads = self.page_size, self.num_kv_heads
        group = num_heads // num_kv_heads
        lens_list = [batch.seq_lens_list[i] for i in seqs]
        max_len = max(lens_list)
        table = batch.page_table.to(device)
        lens = batch.seq_lens.to(device)
        if len(seqs) != batch.num_seqs:
            index = torch.tensor(seqs, dtype=torch.long, device=device)
            table, lens = table.index_select(0, index), lens.index_select(0, index)
        positions = torch.arange(max_len, device=device)
        pages = table[:, positions // page_size].clamp_min(0)  # -1 padding: masked out below
        # Cache row of K of (sequence, kv head 0, token); kv head h is h * P rows further.
        token_rows = pages * (self.kv_planes * num_kv_heads * page_size) + positions % page_size
        head_rows = torch.arange(num_heads, device=device) // group * page_size
        rows = token_rows[:, None, :] + head_rows[None, :, None]  # [Bd, Hq, max_len]
        padding = None
        if all(n == max_len for n in lens_list):
            width: int | None = max_len
            key_rows = rows.reshape(-1)
        elif len(lens_list) * max_len <= _PADDED_SOFTMAX_SLACK * sum(lens_list):
            # Pad shorter rows to the longest: a dense softmax with a mask costs less than the
            # segmented one while the padding stays small. Padding entries repeat the row's
            # first key, so nothing outside the sequence's own pages is read.
            width = max_len
            valid = positions[None, :] < lens[:, None]  # [Bd, max_len]
            key_rows = torch.where(valid[:, None, :], rows, rows[:, :, :1]).reshape(-1)
            padding = ~valid.repeat_interleave(num_heads, dim=0)
        else:
            width = None
            valid = (positions[None, :] < lens[:, None])[:, None, :].expand_as(rows)
            key_rows = rows[valid]
        if width is None:
            row_lens = lens.repeat_interleave(num_heads)
        else:
            row_lens = torch.full((len(lens_list) * num_heads,), width, device=device)
        crow = torch.zeros(row_lens.numel() + 1, dtype=torch.long, device=device)
        torch.cumsum(row_lens, 0, out=crow[1:])
        cache_rows = self.kv_cache[0].numel() // self.kv_cache.shape[-1]
        pattern = torch.sparse_csr_tensor(
            crow,
            key_rows,
            torch.zeros(key_rows.numel(), dtype=self.kv_cache.dtype, device=device),
            size=(row_lens.numel(), cache_rows),
            check_invariants=False,
        )
        return _SparseDecode(
            pattern=pattern,
            value_rows=key_rows + self._value_plane * num_kv_heads * page_size,
            offsets=crow[:-1],
            row_lens=row_lens,
            width=width,
            padding=padding,
        )

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
        v: torch.Tensor | None,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        if self.latent and v is not None:
            raise ValueError("a single-plane (latent) KV cache takes no v: the keys are values")
        if not self.latent and v is None:
            raise ValueError("a two-plane (K|V) KV cache needs v")
        if self._plan is None or self._plan_batch is not batch:
            self.begin_step(batch)
        plan = self._plan
        assert plan is not None
        cache = self.kv_cache[layer]  # [pages, planes, kv_heads, page_size, head_dim]
        # Write first: new tokens must attend to themselves (contract in base.py).
        self._store(cache, plan, k, v)

        decode = plan.decode
        if decode is not None and decode.row_index is None:
            # Every row decodes, already in bucket order: no gather or scatter of rows.
            return self._decode(cache, q, decode)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if plan.kernel_chunks is not None:
            # First: with a q dtype other than the cache's it writes every row (decode rows
            # are overwritten below).
            self._attend_kernel_chunks(cache, q, out, plan.kernel_chunks)
        if decode is not None and decode.row_index is not None:
            rows = decode.row_index
            out.index_copy_(0, rows, self._decode(cache, q.index_select(0, rows), decode))
        for chunk in plan.chunks:
            out[chunk.start : chunk.end] = self._chunk(cache, q, k, v, chunk)
        return out

    def _store(
        self, cache: torch.Tensor, plan: _StepPlan, k: torch.Tensor, v: torch.Tensor | None
    ) -> None:
        planes = (k,) if v is None else (k, v)
        if plan.store_rows is None:
            new_kv = torch.stack(planes, dim=1).to(cache.dtype)  # [T, planes, Hk, D]
            cache[plan.page_index, :, :, plan.slot_in_page] = new_kv
            return
        # One row store per plane into the flat view: no stacked copy of K and V, no 4-index
        # scatter.
        rows = cache.view(-1, cache.shape[-1])
        for plane_rows, values in zip(plan.store_rows, planes, strict=True):
            rows.index_put_((plane_rows,), values.to(cache.dtype))

    def _gather(self, cache: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
        """[planes, Hk, len(page_ids), P, D]: K and V (or the latent) of the pages, heads
        outermost, in the reused buffer (valid until the next gather)."""
        _, kv, heads, page_size, head_dim = cache.shape
        shape = (kv, heads, page_ids.numel(), page_size, head_dim)
        numel = kv * heads * page_ids.numel() * page_size * head_dim
        if self._gather_buffer.numel() < numel:
            self._gather_buffer = torch.empty(numel, dtype=cache.dtype, device=cache.device)
        out = self._gather_buffer[:numel].view(shape)
        return torch.index_select(cache.permute(1, 2, 0, 3, 4), 2, page_ids, out=out)

    def _decode(self, cache: torch.Tensor, q: torch.Tensor, plan: _DecodePlan) -> torch.Tensor:
        """q [Bd, Hq, D] (one token per sequence, in group order) -> [Bd, Hq, D]."""
        if plan.kernel_pages is not None and plan.kernel_lens is not None:
            assert self._kernel is not None
            query = q.to(cache.dtype)  # no copy when equal (the engine's case)
            if query.stride(-1) != 1:
                query = query.contiguous()
            out = torch.empty(query.shape, dtype=cache.dtype, device=cache.device)
            self._kernel(
                out,
                query,
                cache,
                plan.kernel_pages,
                plan.kernel_lens,
                self._value_plane,
                self.scale,
            )
            return out.to(q.dtype)
        if plan.sparse_seqs is not None:
            return self._decode_sparse(cache, q, plan.sparse_seqs)
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = self.num_kv_heads
        # A KV head's query heads are adjacent: [Bd, Hk, group, D] is a view, and the group rows
        # are SDPA's query rows (no causal mask: a decode token sees its whole sequence).
        queries = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        outputs = []
        for group in plan.groups:
            kv = self._gather(cache, group.page_ids).to(q.dtype)  # no copy when equal
            # [planes, Hk, n * pages, P, D] -> [planes, n, Hk, pages * P, D] (views only).
            kv = kv.unflatten(2, (group.end - group.start, group.num_pages))
            kv = kv.flatten(3, 4).transpose(1, 2)
            outputs.append(
                F.scaled_dot_product_attention(
                    queries[group.start : group.end],
                    kv[0, :, :, : group.kv_len],
                    kv[self._value_plane, :, :, : group.kv_len],
                    attn_mask=group.attn_mask,
                    scale=self.scale,
                )
            )
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        return out.reshape(num_seqs, num_heads, head_dim)

    def _attend_kernel_chunks(
        self, cache: torch.Tensor, q: torch.Tensor, out: torch.Tensor, chunks: _KernelChunks
    ) -> None:
        """The chunk rows of ``out`` (contiguous) from the prefill kernel."""
        assert self._prefill_kernel is not None
        query, target = q, out
        if q.dtype != cache.dtype:
            query = q.to(cache.dtype)
            target = torch.empty(q.shape, dtype=cache.dtype, device=cache.device)
        if query.stride(-1) != 1:
            query = query.contiguous()
        self._prefill_kernel(
            target,
            query,
            cache,
            chunks.page_table,
            chunks.query_starts,
            chunks.query_lens,
            chunks.seq_lens,
            self._value_plane,
            self.scale,
        )
        if target is not out:
            out.copy_(target)

    def _decode_sparse(
        self, cache: torch.Tensor, q: torch.Tensor, seqs: tuple[int, ...]
    ) -> torch.Tensor:
        """Decode attention without copying K/V: scores are a sampled matmul of the queries with
        the cache's K rows (``sampled_addmm`` on the step's CSR pattern computes only the entries
        listed: one dot product per (query head, key)), and the output is a weighted sum of the
        cache's V rows (``embedding_bag`` with the probabilities as per-row weights; the key rows
        again in latent mode). Each K and V byte is read from the cache once per query head
        sharing it; nothing is gathered."""
        num_seqs, num_heads, head_dim = q.shape
        if self._sparse is None:
            assert self._plan_batch is not None
            self._sparse = self._sparse_structure(self._plan_batch, seqs, num_heads)
        sparse = self._sparse
        rows = cache.view(-1, head_dim)
        queries = q.reshape(num_seqs * num_heads, head_dim)
        scores = torch.sparse.sampled_addmm(
            sparse.pattern, queries, rows.t(), beta=0.0, alpha=self.scale
        ).values()
        if sparse.width is not None:
            scores = scores.view(-1, sparse.width)
            if sparse.padding is not None:
                scores = scores.masked_fill_(sparse.padding, float("-inf"))
            probs = torch.softmax(scores, dim=-1).view(-1)
            out = F.embedding_bag(
                sparse.value_rows, rows, sparse.offsets, mode="sum", per_sample_weights=probs
            )
        else:
            # Softmax over rows of different lengths: subtract each row's max, weight V by the
            # exponentials, divide by each row's sum at the end.
            row_max = torch.segment_reduce(scores, "max", lengths=sparse.row_lens)
            weights = scores.sub_(
                row_max.repeat_interleave(sparse.row_lens, output_size=scores.numel())
            ).exp_()
            total = torch.segment_reduce(weights, "sum", lengths=sparse.row_lens)
            out = F.embedding_bag(
                sparse.value_rows, rows, sparse.offsets, mode="sum", per_sample_weights=weights
            )
            out = out.div_(total[:, None])
        return out.view(num_seqs, num_heads, head_dim)

    def _chunk(
        self,
        cache: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        chunk: _ChunkPlan,
    ) -> torch.Tensor:
        # SDPA takes its fused CPU kernels only for 4-D inputs; 3-D ones fall back to the slow
        # math path, so a batch dimension of 1 is added.
        query = q[chunk.start : chunk.end].transpose(0, 1)  # [Hq, n, D]
        if chunk.page_ids is None:
            keys = k[chunk.start : chunk.end].transpose(0, 1)
            values = keys if v is None else v[chunk.start : chunk.end].transpose(0, 1)
            out = F.scaled_dot_product_attention(
                query[None],
                keys[None],
                values[None],
                is_causal=True,
                scale=self.scale,
                enable_gqa=True,
            )[0]
        else:
            kv = self._gather(cache, chunk.page_ids).to(q.dtype)  # [planes, Hk, pages, P, D]
            kv = kv.flatten(2, 3)
            out = F.scaled_dot_product_attention(
                query[None],
                kv[0][None],
                kv[self._value_plane][None],
                attn_mask=chunk.attn_mask,
                scale=self.scale,
                enable_gqa=True,
            )[0]
        return out.transpose(0, 1)
