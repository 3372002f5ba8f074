"""Page allocator of the KV pool: page ids, reference counts and the pinned state.

A page is in exactly one of three states:

- free: reference count 0, in the free list;
- allocated: reference count >= 1, owned by one or more sequences; the scheduler may free it
  (preemption by recompute);
- pinned: reference count 1 and non-evictable. Pinned pages are reserved for KV arriving from
  elsewhere (a prefill worker's RDMA writes); nothing may reuse them until whoever pinned them
  hands them over (``unpin``, the pages become ordinary allocated pages) or gives them back
  (``free_pinned``).

Prefix caching (`workers.engine.prefix_cache`): an allocated page whose KV is complete may be
*named* (``register``) by the hash of its tokens; ``lookup`` finds named pages and ``acquire``
shares them with a new owner. A named page whose last owner frees it keeps its name and KV as a
*cached* free page: it counts as free, and ``allocate`` takes plain free pages first, then cached
ones, least recently freed first (the name is dropped then). Pinned pages are never named.

The allocator knows nothing of sequences; the scheduler keeps each sequence's page list.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence

from workers.engine.cache_events import CacheEvents
from workers.engine.errors import CapacityError
from workers.engine.prefix_cache import PageHash

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
        self._name_of: dict[int, PageHash] = {}  # named pages, allocated or cached
        self._page_named: dict[PageHash, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # free named pages, LRU first
        self.events: CacheEvents | None = None  # `track_events`

    def track_events(self, capacity: int) -> CacheEvents:
        """Start recording the names this pool gains and loses (for a router's index)."""
        if self.events is None:
            self.events = CacheEvents(self._page_named.keys, capacity)
        return self.events

    # --- queries ---------------------------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        """Free pages, cached ones included (they are reused when nothing else is free)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached_pages(self) -> int:
        """Free pages that still hold a named page's KV."""
        return len(self._cached)

    @property
    def num_named_pages(self) -> int:
        """Pages holding a named page's KV, in use or cached."""
        return len(self._name_of)

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
        return num_pages <= self.num_free_pages

    def lookup(self, names: Sequence[PageHash]) -> list[int]:
        """The pages named ``names[0]``, ``names[1]``, ... up to the first name not held."""
        pages: list[int] = []
        for name in names:
            page_id = self._page_named.get(name)
            if page_id is None:
                break
            pages.append(page_id)
        return pages

    # --- transitions -----------------------------------------------------------------------

    def allocate(self, num_pages: int) -> list[int]:
        if num_pages < 0:
            raise ValueError(f"cannot allocate {num_pages} pages")
        if num_pages > self.num_free_pages:
            raise CapacityError(f"need {num_pages} KV pages, {self.num_free_pages} free")
        page_ids = [self._take_free() for _ in range(num_pages)]
        for page_id in page_ids:
            self._ref_counts[page_id] = 1
        return page_ids

    def _take_free(self) -> int:
        if self._free:
            return self._free.popleft()
        page_id, _ = self._cached.popitem(last=False)  # evict the least recently freed
        name = self._name_of.pop(page_id)
        del self._page_named[name]
        if self.events is not None:
            self.events.removed(name)
        return page_id

    def acquire(self, page_ids: Iterable[int]) -> None:
        """One more owner for each named page (`lookup`'s), cached free pages included."""
        page_ids = list(page_ids)
        for page_id in page_ids:
            if page_id not in self._name_of:
                raise PageAllocationError(f"page {page_id} is not named; cannot acquire it")
        for page_id in page_ids:
            if self._ref_counts[page_id] == 0:
                del self._cached[page_id]
            self._ref_counts[page_id] += 1

    def register(self, page_id: int, name: PageHash) -> None:
        """Name an allocated page whose KV is complete. A name already held by another page, or
        a page already named, is left as it is (the first page keeps the name)."""
        if self._ref_counts[page_id] == 0 or page_id in self._pinned:
            raise PageAllocationError(f"page {page_id} is free or pinned; cannot name it")
        if name in self._page_named or page_id in self._name_of:
            return
        self._name_of[page_id] = name
        self._page_named[name] = page_id
        if self.events is not None:
            self.events.stored(name)

    def clear_cache(self) -> int:
        """Forget every name (cached free pages become plain free pages); returns how many
        pages were named."""
        count = len(self._name_of)
        self._free.extend(self._cached)
        self._cached.clear()
        self._name_of.clear()
        self._page_named.clear()
        if self.events is not None:
            self.events.cleared()
        return count

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
                if page_id in self._name_of:
                    self._cached[page_id] = None  # the most recently freed: evicted last
                else:
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
        assert not free_set & set(self._cached), "a page is free and cached"
        assert {p: n for n, p in self._page_named.items()} == self._name_of, "names disagree"
        for page_id in self._cached:
            assert page_id in self._name_of, f"cached page {page_id} has no name"
            assert self._ref_counts[page_id] == 0, f"cached page {page_id} is referenced"
        free_set |= set(self._cached)
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
            assert page_id not in self._name_of, f"pinned page {page_id} is named"
