"""Page allocator of the KV pool: page ids, reference counts and the pinned state.

A page is in exactly one of three states:

- free: reference count 0, in the free list;
- allocated: reference count >= 1, owned by one or more sequences; the scheduler may free it
  (preemption by recompute);
- pinned: reference count 1 and non-evictable. Pinned pages are reserved for KV arriving from
  elsewhere (a prefill worker's RDMA writes); nothing may reuse them until whoever pinned them
  hands them over (``unpin``, the pages become ordinary allocated pages) or gives them back
  (``free_pinned``).

The allocator knows nothing of sequences; the scheduler keeps each sequence's page list.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Iterable

from workers.engine.errors import CapacityError

logger = logging.getLogger(__name__)


class PageAllocationError(RuntimeError):
    """A page was freed, pinned or unpinned in a state that does not allow it (a bug)."""


class BlockManager:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError("num_pages and page_size must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        self._ref_counts = [0] * num_pages
        self._pinned: set[int] = set()
        self._free: deque[int] = deque(range(num_pages))

    # --- queries ---------------------------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_pinned_pages(self) -> int:
        return len(self._pinned)

    def is_pinned(self, page_id: int) -> bool:
        return page_id in self._pinned

    def ref_count(self, page_id: int) -> int:
        return self._ref_counts[page_id]

    def pages_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    # --- transitions -----------------------------------------------------------------------

    def allocate(self, num_pages: int) -> list[int]:
        if num_pages < 0:
            raise ValueError(f"cannot allocate {num_pages} pages")
        if num_pages > len(self._free):
            raise CapacityError(f"need {num_pages} KV pages, {len(self._free)} free")
        page_ids = [self._free.popleft() for _ in range(num_pages)]
        for page_id in page_ids:
            self._ref_counts[page_id] = 1
        return page_ids

    def allocate_pinned(self, num_pages: int) -> list[int]:
        page_ids = self.allocate(num_pages)
        self._pinned.update(page_ids)
        return page_ids

    def incref(self, page_ids: Iterable[int]) -> None:
        """Share allocated pages with one more owner."""
        for page_id in page_ids:
            if self._ref_counts[page_id] == 0:
                raise PageAllocationError(f"page {page_id} is free; cannot share it")
            self._ref_counts[page_id] += 1

    def unpin(self, page_ids: Iterable[int]) -> None:
        """Hand pinned pages over to a sequence: they become ordinary allocated pages."""
        page_ids = list(page_ids)
        self._check_pinned(page_ids)  # all checked first: a refused call changes nothing
        self._pinned.difference_update(page_ids)

    def free(self, page_ids: Iterable[int]) -> None:
        """Drop one reference to each page; a page returns to the free list at zero."""
        page_ids = list(page_ids)
        # All checked first: a refused call changes nothing. A page may repeat (one reference
        # per occurrence), so count occurrences against the reference count.
        for page_id, count in Counter(page_ids).items():
            if page_id in self._pinned:
                raise PageAllocationError(
                    f"page {page_id} is pinned: unpin it first or use free_pinned"
                )
            if self._ref_counts[page_id] < count:
                raise PageAllocationError(f"page {page_id} freed twice")
        for page_id in page_ids:
            self._ref_counts[page_id] -= 1
            if self._ref_counts[page_id] == 0:
                self._free.append(page_id)

    def free_pinned(self, page_ids: Iterable[int]) -> None:
        """Give back pinned pages that were never handed over (an aborted transfer)."""
        page_ids = list(page_ids)
        self._check_pinned(page_ids)  # then neither step below can fail half-way
        self.unpin(page_ids)
        self.free(page_ids)

    def _check_pinned(self, page_ids: list[int]) -> None:
        if len(set(page_ids)) != len(page_ids):
            raise PageAllocationError(f"page ids repeat: {page_ids}")
        for page_id in page_ids:
            if page_id not in self._pinned:
                raise PageAllocationError(f"page {page_id} is not pinned")

    # --- checks ----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError when the allocator's bookkeeping is inconsistent."""
        free = list(self._free)
        free_set = set(free)
        assert len(free) == len(free_set), "a page is in the free list twice"
        for page_id in range(self.num_pages):
            ref = self._ref_counts[page_id]
            assert ref >= 0, f"page {page_id} has ref count {ref}"
            if page_id in free_set:
                assert ref == 0, f"free page {page_id} has ref count {ref}"
                assert page_id not in self._pinned, f"free page {page_id} is pinned"
            else:
                assert ref > 0, f"page {page_id} is neither free nor referenced (leak)"
        for page_id in self._pinned:
            assert self._ref_counts[page_id] == 1, f"pinned page {page_id} is shared"
