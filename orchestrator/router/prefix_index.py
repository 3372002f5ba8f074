"""Which prompt prefixes each worker holds, as far as this router can tell: the index behind
the ``kv_aware`` policy.

A prompt is cut into blocks of ``page_size`` tokens, each named by a chained hash of its tokens
and the previous block's name (as the engines name their pages, `workers.engine.prefix_cache`),
so a run of equal names from the first block on is a shared prefix. The router records what it
sends each worker (the prompt when it routes a request, prompt and answer when the answer is
complete: a decoder computed that KV itself and keeps it cached) and forgets a worker that went
down. Workers evict what they need the room for and the router does not hear of it, so the
index is an estimate, bounded per worker (least recently recorded blocks dropped first); a
worker's estimate that is wrong costs only a recompute or a full transfer there, never a wrong
answer.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

_DIGEST_BYTES = 8  # per router and model: a collision misroutes one request, nothing more


class PrefixIndex:
    def __init__(self, page_size: int, max_blocks_per_worker: int) -> None:
        if page_size < 1 or max_blocks_per_worker < 1:
            raise ValueError("page_size and max_blocks_per_worker must be >= 1")
        self.page_size = page_size
        self.max_blocks_per_worker = max_blocks_per_worker
        self._blocks: dict[str, OrderedDict[bytes, None]] = {}

    def blocks(self, token_ids: Sequence[int]) -> list[bytes]:
        """The names of the full blocks of ``token_ids``, in order."""
        names: list[bytes] = []
        previous = b""
        size = self.page_size
        for start in range(0, len(token_ids) - size + 1, size):
            digest = hashlib.blake2b(previous, digest_size=_DIGEST_BYTES)
            digest.update(array("q", token_ids[start : start + size]).tobytes())
            previous = digest.digest()
            names.append(previous)
        return names

    def matched(self, worker_id: str, blocks: Sequence[bytes]) -> int:
        """How many of ``blocks``, from the first on, the worker is thought to hold."""
        held = self._blocks.get(worker_id)
        if not held:
            return 0
        count = 0
        for name in blocks:
            if name not in held:
                break
            count += 1
        return count

    def record(self, worker_id: str, blocks: Sequence[bytes]) -> None:
        """The worker was sent (or computed) the KV of ``blocks``."""
        if not blocks:
            return
        held = self._blocks.setdefault(worker_id, OrderedDict())
        for name in blocks:
            held[name] = None
            held.move_to_end(name)
        while len(held) > self.max_blocks_per_worker:
            held.popitem(last=False)

    def forget(self, worker_id: str) -> None:
        """The worker went down (a replacement starts with an empty cache)."""
        self._blocks.pop(worker_id, None)

    @property
    def num_blocks(self) -> int:
        return sum(len(held) for held in self._blocks.values())
