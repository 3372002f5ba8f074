"""The prefill side's transfers: the live ones by the decoder's request id, those waiting for
the engine, what the engine holds of them, and the records of ended ones.

One lock guards every transfer's state: the step thread, the push thread (its gate, its
checksums) and the fabric's callback thread (a context write never posted) each take it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from typing import Any

from workers.kv.outgoing import Outgoing


class PrefillTable:
    def __init__(self, finished_memory: int) -> None:
        self.lock = threading.Lock()
        self.by_id: dict[str, Outgoing] = {}
        self.queued: deque[Outgoing] = deque()  # accepted, not admitted to the engine yet
        self.reserved_pages = 0  # pages of the prompts admitted to the engine
        # Request ids aborted in the engine whose final ("abort") output is still to come (from
        # its next step). The engine knows requests by the decoder's id: a new request with
        # such an id waits in the queue until that output came, else it would be taken for the
        # new one's (`PassHooks.after_step`) and the new one would be given up yet kept in the
        # engine.
        self.engine_ending: set[str] = set()
        self.finished: OrderedDict[str, dict[str, Any]] = OrderedDict()
        # Writes ever submitted by each ended transfer, by (request id, imm): re-sent aborts.
        self._ended_writes: OrderedDict[tuple[str, int], int] = OrderedDict()
        self._finished_memory = finished_memory

    def live(self, request_id: str, imm: int) -> Outgoing | None:
        """The live transfer of that request and imm (None: ended, or another one's)."""
        out = self.by_id.get(request_id)
        return out if out is not None and out.transfer.imm == imm else None

    def remember(self, out: Outgoing) -> None:
        """Keep an ended transfer's record and its submitted count (bounded)."""
        self.finished[out.request_id] = out.summary()
        while len(self.finished) > self._finished_memory:
            self.finished.popitem(last=False)
        key = (out.request_id, out.transfer.imm)
        self._ended_writes[key] = out.transfer.num_writes_submitted
        while len(self._ended_writes) > self._finished_memory:
            self._ended_writes.popitem(last=False)

    def ended_writes(self, request_id: str, imm: int) -> int:
        """Writes an ended transfer submitted; 0 for one never seen (or forgotten)."""
        return self._ended_writes.get((request_id, imm), 0)

    def count_by_state(self) -> dict[str, int]:
        with self.lock:
            by_state: dict[str, int] = {}
            for out in self.by_id.values():
                by_state[out.transfer.state.value] = by_state.get(out.transfer.state.value, 0) + 1
        return by_state
