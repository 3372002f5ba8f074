"""Which prompt prefixes each worker holds, as far as this router can tell: the index behind
the ``kv_aware`` policy.

A prompt is cut into pages named as the worker's engine names them (`CacheNaming`: a chained
hash from a per-model root, `workers.engine.prefix_cache`), so a run of equal names from the
first page on is a shared prefix. Two sources keep the index current:

- what the workers publish (`apply`): each worker's prefix cache reports the names it gained
  and lost (`workers.engine.cache_events`), fetched by the controller every health check, so
  evictions are seen within seconds;
- what this router sends (`record`): the prompt when it routes a request, prompt and answer when
  the answer is complete, so the next turn of a conversation finds its worker before the
  worker's next report.

It stays an estimate (a recorded prompt may not be cached yet, or anymore), bounded per worker
(least recently touched names dropped first); a wrong estimate costs only a recompute or a
full transfer, never a wrong answer. A worker without a prefix cache is never credited.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from orchestrator.control.registry import WorkerRecord
from workers.engine.cache_events import CacheEventBatch
from workers.engine.prefix_cache import extend_page_hashes
from workers.wire import CacheNaming


class PromptPages:
    """A prompt's full pages, named under each naming the workers use (on first need)."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.token_ids = token_ids
        self._names: dict[CacheNaming, list[bytes]] = {}

    def names(self, naming: CacheNaming) -> list[bytes]:
        names = self._names.get(naming)
        if names is None:
            size = naming.page_size
            names = extend_page_hashes([], self.token_ids, size, len(self.token_ids), naming.salt)
            self._names[naming] = names
        return names


class PrefixIndex:
    def __init__(self, max_blocks_per_worker: int) -> None:
        if max_blocks_per_worker < 1:
            raise ValueError("max_blocks_per_worker must be >= 1")
        self.max_blocks_per_worker = max_blocks_per_worker
        self._held: dict[str, OrderedDict[bytes, None]] = {}

    def matched(self, worker: WorkerRecord, prompt: PromptPages) -> int:
        """How many of the prompt's full pages, from the first on, the worker is thought to
        hold."""
        held = self._held.get(worker.worker_id)
        if not held or worker.cache_naming is None:
            return 0
        count = 0
        for name in prompt.names(worker.cache_naming):
            if name not in held:
                break
            count += 1
        return count

    def matched_tokens(self, worker: WorkerRecord, prompt: PromptPages) -> int:
        naming = worker.cache_naming
        return 0 if naming is None else self.matched(worker, prompt) * naming.page_size

    def share(self, worker: WorkerRecord, prompt: PromptPages) -> float:
        """`matched` as a share of the prompt's full pages (0 for a prompt under one page)."""
        if worker.cache_naming is None:
            return 0.0
        total = len(prompt.names(worker.cache_naming))
        return self.matched(worker, prompt) / total if total else 0.0

    def record(self, worker: WorkerRecord, prompt: PromptPages) -> None:
        """The worker was sent (or computed) the prompt's KV: its cache will hold the pages."""
        if worker.cache_naming is not None:
            self._add(worker.worker_id, prompt.names(worker.cache_naming))

    def apply(self, worker: WorkerRecord, batch: CacheEventBatch) -> None:
        """What the worker's cache gained and lost since its previous batch."""
        if batch.reset:
            self._held.pop(worker.worker_id, None)
        self._add(worker.worker_id, batch.stored)
        held = self._held.get(worker.worker_id)
        if held is not None:
            for name in batch.removed:
                held.pop(name, None)

    def _add(self, worker_id: str, names: Sequence[bytes]) -> None:
        if not names:
            return
        held = self._held.setdefault(worker_id, OrderedDict())
        for name in names:
            held[name] = None
            held.move_to_end(name)
        while len(held) > self.max_blocks_per_worker:
            held.popitem(last=False)

    def forget(self, worker_id: str) -> None:
        """The worker went down (a replacement starts with an empty cache)."""
        self._held.pop(worker_id, None)

    @property
    def num_blocks(self) -> int:
        return sum(len(held) for held in self._held.values())
