"""Page-id runs: the coalescing rule both ends of a KV transfer must apply identically.

A *run* is a maximal sequence of consecutive request page indices where the source page id and
the destination page id both increase by exactly 1. In the pool layout
``[num_layers, num_pages, kv_planes, kv_heads_local, page_size, head_dim]`` (planes K and V, or
MLA's one latent) consecutive page ids of one layer are consecutive bytes, so a run of whole
pages is one RDMA write.

Runs may additionally be cut at *segment* boundaries: request page indices that are multiples of
``segment_pages``. Chunked prefill produces a layer's KV one chunk at a time, so a run cannot be
written before its last page exists; when chunk boundaries fall on segment boundaries no run ever
straddles two forward passes and the writer never has to hold pages back. The decoder computes
its expected write count with the same ``segment_pages``, so the count never depends on how the
prefill scheduler happened to chunk the prompt.

Finally a run longer than ``max_pages_per_run`` is split into pieces of at most that many pages
from its start (a single write may not exceed the provider's ``max_msg_size``). The rule itself
has one definition, `workers.fabric.paging.coalesce_page_runs`; this module returns its runs as
tuples and adds the chunked-prefill helpers.
"""

from __future__ import annotations

from collections.abc import Sequence

from workers.fabric import paging


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
    runs = paging.coalesce_page_runs(
        src_pages,
        dst_pages,
        segment_pages=segment_pages,
        first_page_index=first_page_index,
        max_pages_per_run=max_pages_per_run,
    )
    return [(int(s), int(d), int(n)) for s, d, n in runs.tolist()]


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
