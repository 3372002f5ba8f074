"""Page-id runs: the coalescing rule both ends of a KV transfer must apply identically.

A *run* is a maximal sequence of consecutive request page indices where the source page id and
the destination page id both increase by exactly 1. In the pool layout
``[num_layers, num_pages, 2, kv_heads_local, page_size, head_dim]`` consecutive page ids of one
layer are consecutive bytes, so a run of whole pages is one RDMA write.

Runs may additionally be cut at *segment* boundaries: request page indices that are multiples of
``segment_pages``. Chunked prefill produces a layer's KV one chunk at a time, so a run cannot be
written before its last page exists; when chunk boundaries fall on segment boundaries no run ever
straddles two forward passes and the writer never has to hold pages back. The decoder computes
its expected write count with the same ``segment_pages``, so the count never depends on how the
prefill scheduler happened to chunk the prompt.

Finally a run longer than ``max_pages_per_run`` is split into pieces of at most that many pages
from its start (a single write may not exceed the provider's ``max_msg_size``); this is the same
rule as `workers.fabric.paging.coalesce_page_runs`, with which the function agrees whenever
``segment_pages`` is None.
"""

from __future__ import annotations

from collections.abc import Sequence


def coalesce_page_runs(
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
    *,
    segment_pages: int | None = None,
    first_page_index: int = 0,
    max_pages_per_run: int | None = None,
) -> list[tuple[int, int, int]]:
    """Return ``(src_start, dst_start, length)`` page-id runs covering the pages in order.

    ``first_page_index`` is the request page index of ``src_pages[0]`` (only matters with
    ``segment_pages``, whose boundaries are counted from the start of the request).
    """
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"page lists differ in length: {len(src_pages)} != {len(dst_pages)}")
    if segment_pages is not None and segment_pages < 1:
        raise ValueError(f"segment_pages must be >= 1 or None, got {segment_pages}")
    if first_page_index < 0:
        raise ValueError(f"first_page_index must be >= 0, got {first_page_index}")
    if max_pages_per_run is not None and max_pages_per_run < 1:
        raise ValueError(f"max_pages_per_run must be >= 1 or None, got {max_pages_per_run}")
    runs: list[tuple[int, int, int]] = []
    for index, (src, dst) in enumerate(zip(src_pages, dst_pages, strict=True)):
        if src < 0 or dst < 0:
            raise ValueError(f"negative page id at index {index}: src={src}, dst={dst}")
        at_boundary = segment_pages is not None and (first_page_index + index) % segment_pages == 0
        if runs and not at_boundary:
            src_start, dst_start, length = runs[-1]
            if src == src_start + length and dst == dst_start + length:
                runs[-1] = (src_start, dst_start, length + 1)
                continue
        runs.append((src, dst, 1))
    if max_pages_per_run is None:
        return runs
    return [
        (src + offset, dst + offset, min(max_pages_per_run, length - offset))
        for src, dst, length in runs
        for offset in range(0, length, max_pages_per_run)
    ]


def num_pages_for_tokens(num_tokens: int, page_size: int) -> int:
    """Pages holding the KV of ``num_tokens`` tokens (the last page may be partly filled)."""
    if num_tokens < 0 or page_size < 1:
        raise ValueError(f"need num_tokens >= 0 and page_size >= 1, got {num_tokens}, {page_size}")
    return -(-num_tokens // page_size)


def sendable_pages(
    num_pages_done: int, num_pages_total: int, num_pages_sent: int, segment_pages: int | None
) -> range:
    """Request page indices a writer may send now without ever splitting a run differently.

    ``num_pages_done`` pages have their KV for the layer in question (chunk boundaries are
    page-aligned); ``num_pages_sent`` were already sent. Without segments only the complete
    request may be sent (one run may span every page); with segments, every completed segment.
    """
    if not 0 <= num_pages_sent <= num_pages_done <= num_pages_total:
        raise ValueError(
            f"need 0 <= sent ({num_pages_sent}) <= done ({num_pages_done}) "
            f"<= total ({num_pages_total})"
        )
    if num_pages_done == num_pages_total:
        return range(num_pages_sent, num_pages_total)
    if segment_pages is None:
        return range(num_pages_sent, num_pages_sent)
    end = max(num_pages_sent, num_pages_done - num_pages_done % segment_pages)
    return range(num_pages_sent, end)
