"""Range checks of write calls, and their rows laid out as the native arrays `pd_post_writes`
reads.

A write row is ``(src_offset, dst_offset, length)``. Every check here runs on the caller's
thread before anything is queued, and never forms an int64 sum that could wrap
(``offset <= limit - length``, page arithmetic checked in Python ints): a wrapped sum could
pass a check and post a write outside the region.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from workers.fabric import paging
from workers.fabric._lib import ffi
from workers.fabric.descriptors import MemoryRegionDescriptor
from workers.fabric.errors import OutOfRangeError
from workers.fabric.handles import MemoryRegionHandle, PeerHandle

if TYPE_CHECKING:
    from workers.fabric._fabric_cffi import IntPointer

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass(frozen=True, eq=False)
class PreparedWrites:
    """Writes checked and laid out by `TransferEngine.prepare_writes`, to be queued later in
    row ranges by `submit_prepared`; valid only with the engine that prepared them."""

    src: MemoryRegionHandle
    peer: PeerHandle
    dst: MemoryRegionDescriptor
    # Native local addresses, lengths, remote addresses (one entry per row) ...
    pointers: tuple[IntPointer, IntPointer, IntPointer] = field(repr=False)
    arrays: tuple[np.ndarray, ...] = field(repr=False)  # ... and what they point into
    ends: list[int] = field(repr=False)  # ends[i]: bytes of rows [0, i)

    def __len__(self) -> int:
        return len(self.ends) - 1


def check_span(what: str, offset: int, length: int, limit: int) -> None:
    """``[offset, offset + length)`` lies in ``[0, limit)`` (Python ints: no wrap)."""
    if offset < 0 or offset + length > limit:
        raise OutOfRangeError(
            f"write [{offset}, {offset + length}) is outside the {what} of {limit} bytes"
        )


def rows_of(ops: np.ndarray) -> np.ndarray:
    """``ops`` as int64 rows of ``(src_offset, dst_offset, length)``."""
    rows = np.asarray(ops, dtype=np.int64)
    if rows.ndim != 2 or rows.shape[1] != 3:
        raise OutOfRangeError(f"ops must be rows of (src, dst, length), got {rows.shape}")
    return rows


def paged_rows(
    src_pages: paging.PageList,
    dst_pages: paging.PageList,
    page_bytes: int,
    *,
    src_stride: int | None,
    dst_stride: int | None,
    src_offset: int,
    dst_offset: int,
    max_pages_per_run: int | None,
) -> np.ndarray:
    """The write rows of `TransferEngine.submit_paged_writes`: one per run of pages (see
    `paging`); a stride of None is ``page_bytes``."""
    src_stride = page_bytes if src_stride is None else src_stride
    dst_stride = page_bytes if dst_stride is None else dst_stride
    if page_bytes <= 0 or src_stride < page_bytes or dst_stride < page_bytes:
        raise OutOfRangeError(
            f"page_bytes {page_bytes} must be positive and <= strides {src_stride}/{dst_stride}"
        )
    runs = paging.coalesce_page_runs(
        src_pages,
        dst_pages,
        coalesce=paging.can_coalesce(page_bytes, src_stride, dst_stride),
        max_pages_per_run=max_pages_per_run,
    )
    _check_page_arithmetic(runs, page_bytes, (src_offset, src_stride), (dst_offset, dst_stride))
    ops = np.empty((runs.shape[0], 3), dtype=np.int64)
    ops[:, 0] = src_offset + runs[:, 0] * src_stride
    ops[:, 1] = dst_offset + runs[:, 1] * dst_stride
    ops[:, 2] = runs[:, 2] * page_bytes
    return ops


def lay_out(
    src: MemoryRegionHandle,
    peer: PeerHandle,
    dst: MemoryRegionDescriptor,
    rows: np.ndarray,
    max_write_bytes: int,
) -> PreparedWrites:
    """Range-check ``rows`` (non-empty) and build their native arrays."""
    src_off, dst_off, lengths = rows[:, 0], rows[:, 1], rows[:, 2]
    if int(lengths.min()) <= 0:
        raise OutOfRangeError("every write needs a positive length")
    _check_extent("source region", src_off, lengths, src.length)
    _check_extent("destination descriptor", dst_off, lengths, dst.length)
    if int(lengths.max()) > max_write_bytes:
        raise OutOfRangeError(f"write of {int(lengths.max())} bytes exceeds max_msg_size")
    laddr = (src_off + src.address).astype(np.uint64)
    raddr = (dst_off + dst.base).astype(np.uint64)
    lens = lengths.astype(np.uint64)
    pointers = (_native(laddr), _native(lens), _native(raddr))
    ends = np.concatenate(([0], np.cumsum(lengths))).tolist()
    return PreparedWrites(src, peer, dst, pointers, (laddr, lens, raddr), ends)


def _native(array: np.ndarray) -> IntPointer:
    return ffi.cast("uint64_t *", ffi.from_buffer(array))


def _check_page_arithmetic(
    runs: np.ndarray, page_bytes: int, src: tuple[int, int], dst: tuple[int, int]
) -> None:
    """The int64 arithmetic that turns ``runs`` into byte rows (``offset + page * stride``,
    ``pages * page_bytes``; ``src``/``dst`` are ``(offset, stride)``) cannot wrap around:
    checked in Python ints. Beyond int64 is outside every region, hence out of range."""
    if runs.shape[0] == 0:
        return
    for what, (offset, stride), column in (("source", src, 0), ("destination", dst, 1)):
        span = int(runs[:, column].max()) * stride
        if offset < _INT64_MIN or max(stride, span, offset + span) + page_bytes > _INT64_MAX:
            raise OutOfRangeError(
                f"{what} page at byte offset {offset + span} (+{page_bytes}) is outside any region"
            )
    if int(runs[:, 2].max()) * page_bytes > _INT64_MAX:
        raise OutOfRangeError(f"a run of {int(runs[:, 2].max())} pages is outside any region")


def _check_extent(what: str, offsets: np.ndarray, lengths: np.ndarray, limit: int) -> None:
    """Every row ``[offset, offset + length)`` (lengths positive) lies in ``[0, limit)``.

    Never forms ``offsets + lengths``: int64 sums wrap (2**62 + 2**62 < 0). With the lengths
    in ``[1, limit]``, ``limit - lengths`` cannot overflow, and offsets are compared to it."""
    limit = min(limit, _INT64_MAX)  # a descriptor may claim up to 2**64 - 1 bytes
    outside = (offsets < 0) | (lengths > limit) | (offsets > limit - lengths)
    if outside.any():
        bad = int(np.argmax(outside))
        start, end = int(offsets[bad]), int(offsets[bad]) + int(lengths[bad])  # Python ints
        raise OutOfRangeError(f"write [{start}, {end}) is outside the {what} of {limit} bytes")
