"""FlashInfer attention over the paged HND cache (CUDA only; imported lazily).

One ``BatchPrefillWithPagedKVCacheWrapper`` serves the whole mixed batch: a decode token is a
query of length 1, a prefill chunk a longer one, and FlashInfer's causal mask is aligned to the
end of each sequence's KV, which is exactly "cached context + new tokens up to itself". The
wrapper is planned once per step in `begin_step` (page-table CSR built from the
`AttentionBatch`; pass ``num_qo_heads`` at construction, else planning waits for the step's first
layer) and run for every layer on ``kv_cache[layer]``, whose
``[pages, 2, kv_heads, page_size, head_dim]`` shape is FlashInfer's HND paged layout.

FlashInfer kernels take float16 / bfloat16 caches only, with K and V planes: an MLA latent cache
(one plane) is refused (`NotImplementedError`) and runs on the torch backend. Tested only on
CUDA machines.
"""

from __future__ import annotations

import torch

from workers.engine.attention.base import AttentionBackend, AttentionBatch

_WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(
        self,
        kv_cache: torch.Tensor,
        page_size: int,
        scale: float,
        num_qo_heads: int | None = None,
    ) -> None:
        super().__init__(kv_cache, page_size, scale)
        if kv_cache.shape[2] != 2:
            # The paged wrapper reads separate K and V planes; latent mode (V = K) is not wired.
            raise NotImplementedError("MLA latent caches run on the torch backend, not flashinfer")
        if not kv_cache.is_cuda:
            raise RuntimeError("the flashinfer attention backend needs the KV cache on CUDA")
        if kv_cache.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError(
                f"flashinfer needs a float16/bfloat16 KV cache, not {kv_cache.dtype}"
            )
        import flashinfer

        self._num_kv_heads = kv_cache.shape[3]
        self._head_dim = kv_cache.shape[5]
        workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=kv_cache.device)
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="HND")
        self._batch: AttentionBatch | None = None  # the step begin_step saw
        self._planned: AttentionBatch | None = None  # the step the wrapper is planned for
        # Known up front, planning happens in begin_step (outside any CUDA graph capture);
        # otherwise at the step's first forward, once q shows the head count.
        self._num_qo_heads = num_qo_heads
        self._planned_heads: int | None = None
        self._page_index = torch.empty(0, dtype=torch.long, device=kv_cache.device)
        self._slot_in_page = torch.empty(0, dtype=torch.long, device=kv_cache.device)

    def begin_step(self, batch: AttentionBatch) -> None:
        self._planned = None
        slots = batch.slot_mapping.to(self.kv_cache.device)
        self._page_index = torch.div(slots, self.page_size, rounding_mode="floor")
        self._slot_in_page = torch.remainder(slots, self.page_size)
        self._batch = batch
        if self._num_qo_heads is not None:
            self._plan(batch, self._num_qo_heads)

    def _plan(self, batch: AttentionBatch, num_qo_heads: int) -> None:
        device = self.kv_cache.device
        pages_per_seq = [-(-n // self.page_size) for n in batch.seq_lens_list]
        kv_indptr = [0]
        for count in pages_per_seq:
            kv_indptr.append(kv_indptr[-1] + count)
        table = batch.page_table.to(device)
        indices = torch.cat([table[i, :count] for i, count in enumerate(pages_per_seq)])
        # FlashInfer counts the valid slots of each sequence's last page (1..page_size).
        last_page_len = [
            n - (count - 1) * self.page_size
            for n, count in zip(batch.seq_lens_list, pages_per_seq, strict=True)
        ]
        # The first eight arguments are positional: their order is stable across FlashInfer
        # releases, while the head-dim keyword was renamed (head_dim -> head_dim_qk).
        self._wrapper.plan(
            batch.query_start_loc.to(device=device, dtype=torch.int32),
            torch.tensor(kv_indptr, dtype=torch.int32, device=device),
            indices.to(torch.int32),
            torch.tensor(last_page_len, dtype=torch.int32, device=device),
            num_qo_heads,
            self._num_kv_heads,
            self._head_dim,
            self.page_size,
            causal=True,
            sm_scale=self.scale,
            q_data_type=self.kv_cache.dtype,
            kv_data_type=self.kv_cache.dtype,
        )
        self._planned = batch
        self._planned_heads = num_qo_heads

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        if v is None:
            raise ValueError("a two-plane (K|V) KV cache needs v")
        if self._batch is not batch:
            self.begin_step(batch)
        if self._planned is not batch or self._planned_heads != q.shape[1]:
            self._plan(batch, q.shape[1])
        cache = self.kv_cache[layer]
        cache[self._page_index, 0, :, self._slot_in_page] = k.to(cache.dtype)
        cache[self._page_index, 1, :, self._slot_in_page] = v.to(cache.dtype)
        out: torch.Tensor = self._wrapper.run(q.to(cache.dtype).contiguous(), cache)
        return out.to(q.dtype)
