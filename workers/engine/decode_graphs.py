"""Pure-decode steps at fixed shapes, replayed as CUDA graphs.

A decode step of a small batch is bound by kernel launches and Python on a GPU, not by the GPU:
each of the step's few hundred kernels costs a launch, and the attention backend plans per step
on the host. A CUDA graph replays the whole forward pass as one launch. That needs fixed shapes
and no host work inside the pass, so a step runs here at a *shape* ``(batch, pages)``:

- ``batch``: the number of sequences rounded up to a power of two (at most ``max_batch``). Rows
  past the real ones repeat row 0 (its token, position, slot and pages): they compute the same
  K/V as row 0 and store it into row 0's slot, which changes nothing, and their logits are
  dropped.
- ``pages``: the longest sequence's page count rounded up to a power of two (at most the pages
  of ``max_model_len``). Each row's page table is padded with its own first page; attention
  masks keys past the row's length.

All inputs of a shape live in one device buffer (`_rows`), filled from the host with one copy
per step. Attention (`StaticDecodeAttention`) stores the new K/V, gathers each row's pages and
calls ``scaled_dot_product_attention`` with a length mask, reading only those buffers. Every
shape's graph is captured on first use, with that step's real inputs (a warm-up pass writes
the same K/V the replay writes again), and kept; all graphs share one memory pool.

With ``capture=False`` the same fixed-shape pass runs eagerly: that is how CPU tests check it
token for token against HF. Not used for models with dynamic RoPE scaling, whose tables depend
on each step's lengths (the engine then runs every step eagerly), nor for MLA's single-plane
latent cache (`StaticDecodeAttention` reads K and V planes; latent caches run on the torch
backend).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from workers.engine.attention.base import AttentionBackend, AttentionBatch
from workers.engine.layer_progress import LayerProgress
from workers.engine.model import CausalLM
from workers.engine.scheduler import SchedulerOutput

# Columns of a row of `_rows`: token, position, slot, sequence length, then its page table.
_TOKEN, _POSITION, _SLOT, _SEQ_LEN, _PAGES = range(5)


def _round_up_pow2(n: int, limit: int) -> int:
    return min(1 << max(0, n - 1).bit_length(), limit)


class StaticDecodeAttention(AttentionBackend):
    """Decode attention (one new token per sequence) at a fixed shape, without host work.

    The batch's ``page_table`` has no -1 padding (rows are padded with real pages) and
    ``seq_lens`` masks the keys; `begin_step` derives the store indices and the mask on the
    device, so a CUDA graph that captured it recomputes them on replay.
    """

    name = "static-decode"

    def __init__(self, kv_cache: torch.Tensor, page_size: int, scale: float) -> None:
        if kv_cache.shape[2] != 2:
            raise NotImplementedError("MLA latent caches run on the torch backend, not in graphs")
        super().__init__(kv_cache, page_size, scale)
        self._page_index = torch.empty(0, dtype=torch.long, device=kv_cache.device)
        self._slot_in_page = torch.empty(0, dtype=torch.long, device=kv_cache.device)
        self._mask = torch.empty(0, dtype=torch.bool, device=kv_cache.device)

    def begin_step(self, batch: AttentionBatch) -> None:
        slots = batch.slot_mapping
        self._page_index = torch.div(slots, self.page_size, rounding_mode="floor")
        self._slot_in_page = torch.remainder(slots, self.page_size)
        keys = batch.page_table.shape[1] * self.page_size
        positions = torch.arange(keys, device=slots.device)
        self._mask = (positions[None, :] < batch.seq_lens[:, None])[:, None, None, :]

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
        cache = self.kv_cache[layer]  # [pages, 2, kv_heads, page_size, head_dim]
        cache[self._page_index, 0, :, self._slot_in_page] = k.to(cache.dtype)
        cache[self._page_index, 1, :, self._slot_in_page] = v.to(cache.dtype)
        rows, pages = batch.page_table.shape
        _, _, kv_heads, page_size, head_dim = cache.shape
        kv = cache.index_select(0, batch.page_table.reshape(-1)).to(q.dtype)
        # [rows * pages, 2, Hk, P, D] -> [2, rows, Hk, pages * P, D]
        kv = kv.view(rows, pages, 2, kv_heads, page_size, head_dim).permute(2, 0, 3, 1, 4, 5)
        kv = kv.reshape(2, rows, kv_heads, pages * page_size, head_dim)
        num_heads = q.shape[1]
        # A KV head's query heads are adjacent: they are SDPA's query rows for that head.
        queries = q.view(rows, kv_heads, num_heads // kv_heads, head_dim)
        out = F.scaled_dot_product_attention(
            queries, kv[0], kv[1], attn_mask=self._mask, scale=self.scale
        )
        return out.reshape(rows, num_heads, head_dim)


class DecodeGraphs:
    """Runs pure-decode steps at fixed shapes; on CUDA (``capture=True``) as CUDA graphs."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: torch.Tensor,
        page_size: int,
        layer_progress: LayerProgress,
        *,
        scale: float,
        max_batch: int,
        max_model_len: int,
        capture: bool,
    ) -> None:
        if model.rotary.is_dynamic:
            raise ValueError("dynamic RoPE scaling depends on each step's lengths")
        self.model = model
        self.page_size = page_size
        self.layer_progress = layer_progress
        self.max_batch = max_batch
        self.max_pages = -(-max_model_len // page_size)
        self.capture = capture
        device = kv_cache.device
        self.backend = StaticDecodeAttention(kv_cache, page_size, scale)
        # Every position a shape can ask for, up front: captured graphs read this table.
        model.rotary.reserve(self.max_pages * page_size, device)
        self._rows = torch.zeros(
            max_batch, _PAGES + self.max_pages, dtype=torch.long, device=device
        )
        self._host = torch.zeros_like(self._rows, device="cpu", pin_memory=device.type == "cuda")
        # (batch, pages) -> (graph, its logits buffer); graphs share one memory pool.
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self._pool: Any = None
        self.steps = 0  # steps run here (tests and logs read it)

    def accepts(self, step: SchedulerOutput) -> bool:
        return (
            0 < len(step.seqs) <= self.max_batch
            and all(n == 1 for n in step.num_new_tokens)
            and all(chunk.samples for chunk in step.chunks)
            and max(len(seq.page_ids) for seq in step.seqs) <= self.max_pages
        )

    def run(self, step: SchedulerOutput) -> torch.Tensor:
        """float32 logits [len(step.seqs), vocab] of the step (a view, valid until the next)."""
        num_seqs = len(step.seqs)
        batch = _round_up_pow2(num_seqs, self.max_batch)
        pages = _round_up_pow2(max(len(seq.page_ids) for seq in step.seqs), self.max_pages)
        self._fill(step, batch, pages)
        self.steps += 1
        if not self.capture:
            return self._forward(batch, pages)[:num_seqs]
        entry = self.graphs.get((batch, pages))
        if entry is None:
            entry = self.graphs[(batch, pages)] = self._capture(batch, pages)
        graph, logits = entry
        graph.replay()
        return logits[:num_seqs]

    def _fill(self, step: SchedulerOutput, batch: int, pages: int) -> None:
        page_size = self.page_size
        rows: list[list[int]] = []
        for seq in step.seqs:
            position = seq.num_computed_tokens
            table = seq.page_ids
            slot = table[position // page_size] * page_size + position % page_size
            rows.append(
                [seq.token_ids[position], position, slot, position + 1]
                + table
                + [table[0]] * (pages - len(table))
            )
        rows.extend([rows[0]] * (batch - len(rows)))
        # The previous step's copy from this buffer is done: its logits were read on the host.
        self._host[:batch, : _PAGES + pages] = torch.tensor(rows, dtype=torch.long)
        self._rows[:batch].copy_(self._host[:batch], non_blocking=True)

    def _forward(self, batch: int, pages: int) -> torch.Tensor:
        rows = self._rows[:batch]
        seq_lens = rows[:, _SEQ_LEN]
        attention = AttentionBatch(
            query_start_loc=torch.arange(batch + 1, device=rows.device),
            seq_lens=seq_lens,
            context_lens=seq_lens - 1,
            page_table=rows[:, _PAGES : _PAGES + pages],
            slot_mapping=rows[:, _SLOT],
            query_lens_list=(1,) * batch,
            # The host-side bound of every position (the RoPE table holds it, see __init__).
            seq_lens_list=(pages * self.page_size,) * batch,
        )
        hidden = self.model.forward(
            rows[:, _TOKEN], rows[:, _POSITION], attention, self.backend, self.layer_progress
        )
        return self.model.compute_logits(hidden)

    def _capture(self, batch: int, pages: int) -> tuple[Any, torch.Tensor]:
        # Warm up on a side stream first (library handles, kernel choices), as CUDA graph
        # capture requires; it stores the step's K/V, which the replay stores again.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(batch, pages)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # Graphs are captured while serving, when the fabric's progress thread may be moving KV
        # through CUDA (FI_HMEM: synchronous copies, IPC handle opens). In the default "global"
        # mode such a call on any thread during a capture fails (and fails the transfer);
        # "thread_local" restricts the capture rules to this thread, which makes none of them.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = self._forward(batch, pages)
        self._pool = graph.pool()
        return graph, logits
