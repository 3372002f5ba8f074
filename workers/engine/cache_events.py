"""What a pool's prefix cache gained and lost since it was last asked: the events a worker
publishes so that a router can tell which prompt prefixes it holds (``kv_aware`` routing).

The allocator (`workers.engine.block_manager`) reports each page name it starts holding
(``stored``) and each it drops (``removed``: the page was reused, or the cache cleared). Only
the net change per name is kept between two drains, so the buffer is bounded by the names that
changed, not by the traffic; past ``capacity`` changed names it gives up counting and the next
batch is a full snapshot instead (``reset``), as is the first batch of all: a reader that
applies every batch in order holds exactly the names the pool holds at the last drain.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from workers.engine.prefix_cache import PageHash


@dataclass(frozen=True)
class CacheEventBatch:
    """``reset``: forget every name held before, then apply ``stored`` (the whole pool)."""

    stored: tuple[PageHash, ...] = ()
    removed: tuple[PageHash, ...] = ()
    reset: bool = False


class CacheEvents:
    def __init__(self, snapshot: Callable[[], Iterable[PageHash]], capacity: int) -> None:
        """``snapshot``: every name the pool holds now (for a reset batch)."""
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._snapshot = snapshot
        self.capacity = capacity
        self._changed: dict[PageHash, bool] = {}  # name -> held after its last change
        self._reset = True  # the reader has seen nothing yet

    def stored(self, name: PageHash) -> None:
        self._change(name, True)

    def removed(self, name: PageHash) -> None:
        self._change(name, False)

    def cleared(self) -> None:
        self._changed.clear()
        self._reset = True

    def _change(self, name: PageHash, held: bool) -> None:
        if self._reset:
            return  # the next batch is a snapshot anyway
        self._changed[name] = held
        if len(self._changed) > self.capacity:
            self.cleared()

    def drain(self) -> CacheEventBatch:
        if self._reset:
            self._reset = False
            self._changed.clear()
            return CacheEventBatch(stored=tuple(self._snapshot()), reset=True)
        changed, self._changed = self._changed, {}
        return CacheEventBatch(
            stored=tuple(name for name, held in changed.items() if held),
            removed=tuple(name for name, held in changed.items() if not held),
        )
