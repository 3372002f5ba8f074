"""Page-run coalescing: the one rule both sides use to count writes.

A *run* is a maximal sequence of positions i..j where consecutive source pages map to
consecutive destination pages (``src[k+1] == src[k] + 1`` and ``dst[k+1] == dst[k] + 1``).
When both strides equal the page size, a run is contiguous in memory on both sides and moves in
one write; otherwise (a head-shard of a page, strided layouts) every page is its own write.
Runs are additionally cut where the *request page index* (``first_page_index + i``) is a multiple
of ``segment_pages`` (chunked prefill sends whole segments; see `workers.kv.pages`). Runs longer
than ``max_pages_per_run`` are split. This module is the single definition of the rule:
`workers.kv.pages.coalesce_page_runs` wraps it. The initiator (`submit_paged_writes`) and the
decoder that arms the immediate counter must call `count_paged_write_runs` with the same
arguments to agree on the number of writes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

PageList = Sequence[int] | npt.NDArray[np.integer]


def can_coalesce(page_bytes: int, src_stride: int | None, dst_stride: int | None) -> bool:
    """Whether adjacent pages are adjacent bytes on both sides (None = stride is page_bytes)."""
    return (src_stride in (None, page_bytes)) and (dst_stride in (None, page_bytes))


def _as_pages(pages: PageList, name: str) -> npt.NDArray[np.int64]:
    array = np.asarray(pages, dtype=np.int64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional")
    if array.size and int(array.min()) < 0:
        raise ValueError(f"{name} has a negative page index")
    return array


def coalesce_page_runs(
    src_pages: PageList,
    dst_pages: PageList,
    *,
    coalesce: bool = True,
    max_pages_per_run: int | None = None,
    segment_pages: int | None = None,
    first_page_index: int = 0,
) -> npt.NDArray[np.int64]:
    """Runs as an int64 array of rows ``(src_start, dst_start, num_pages)``, in list order.

    ``first_page_index`` is the request page index of ``src_pages[0]`` (only matters with
    ``segment_pages``, whose boundaries count from the start of the request).
    """
    src = _as_pages(src_pages, "src_pages")
    dst = _as_pages(dst_pages, "dst_pages")
    if src.shape != dst.shape:
        raise ValueError(f"src_pages has {src.size} pages but dst_pages has {dst.size}")
    if max_pages_per_run is not None and max_pages_per_run < 1:
        raise ValueError(f"max_pages_per_run must be >= 1 or None, got {max_pages_per_run}")
    if segment_pages is not None and segment_pages < 1:
        raise ValueError(f"segment_pages must be >= 1 or None, got {segment_pages}")
    if first_page_index < 0:
        raise ValueError(f"first_page_index must be >= 0, got {first_page_index}")
    if src.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    if coalesce:
        breaks = (np.diff(src) != 1) | (np.diff(dst) != 1)
        if segment_pages is not None:
            indices = first_page_index + np.arange(1, src.size)
            breaks |= indices % segment_pages == 0
        starts = np.concatenate(([0], np.nonzero(breaks)[0] + 1))
    else:
        starts = np.arange(src.size)
    lengths = np.diff(np.concatenate((starts, [src.size])))
    runs = np.stack((src[starts], dst[starts], lengths), axis=1)
    if max_pages_per_run is not None and int(lengths.max()) > max_pages_per_run:
        runs = _split_long_runs(runs, max_pages_per_run)
    return runs


def _split_long_runs(runs: npt.NDArray[np.int64], limit: int) -> npt.NDArray[np.int64]:
    rows: list[tuple[int, int, int]] = []
    for src_start, dst_start, length in runs.tolist():
        for offset in range(0, length, limit):
            rows.append((src_start + offset, dst_start + offset, min(limit, length - offset)))
    return np.asarray(rows, dtype=np.int64)


def count_paged_write_runs(
    src_pages: PageList,
    dst_pages: PageList,
    *,
    coalesce: bool = True,
    max_pages_per_run: int | None = None,
) -> int:
    """Number of writes `submit_paged_writes` posts for these pages (see module docstring)."""
    return int(
        coalesce_page_runs(
            src_pages, dst_pages, coalesce=coalesce, max_pages_per_run=max_pages_per_run
        ).shape[0]
    )
