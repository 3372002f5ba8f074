"""An `AttentionBatch` for runs of consecutive positions of several sequences: a scheduled step
(`model_runner`) or a drafter's pass (`mtp_drafter`, `draft_model`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.engine.attention.base import AttentionBatch


def paged_batch(
    runs: Sequence[tuple[Sequence[int], int, int]],
    page_size: int,
    device: torch.device,
    num_prompt_tokens: Sequence[int] | None = None,
) -> tuple[torch.Tensor, AttentionBatch]:
    """``runs``: (page ids, first position, count) per sequence, the positions ``first ..
    first + count`` computed now over the KV of those before. Returns the positions [T] and the
    batch (with ``num_prompt_tokens``, each sequence's prompt length, when given)."""
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    for pages, start, count in runs:
        end = start + count
        positions.extend(range(start, end))
        slots.extend(pages[p // page_size] * page_size + p % page_size for p in range(start, end))
        query_lens.append(count)
        seq_lens.append(end)
    max_pages = max(len(pages) for pages, _, _ in runs)
    table = [list(pages) + [-1] * (max_pages - len(pages)) for pages, _, _ in runs]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)

    def tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    batch = AttentionBatch(
        query_start_loc=tensor(starts),
        seq_lens=tensor(seq_lens),
        context_lens=tensor([s - q for s, q in zip(seq_lens, query_lens, strict=True)]),
        page_table=tensor(table),
        slot_mapping=tensor(slots),
        query_lens_list=tuple(query_lens),
        seq_lens_list=tuple(seq_lens),
        num_prompt_tokens=tensor(list(num_prompt_tokens))
        if num_prompt_tokens is not None
        else None,
    )
    return tensor(positions), batch


def last_rows(batch: AttentionBatch) -> torch.Tensor:
    """[B] the row of each sequence's last position."""
    return batch.query_start_loc[1:] - 1
