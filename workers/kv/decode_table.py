"""The decode side's transfers: the live ones by request id, those pending (no pages or slot
yet, in arrival order), and the bounded records of ended ones and of the hidden states that
arrived (step thread only)."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import Any

import torch

from workers.kv.incoming import Incoming
from workers.kv.transfer_state import WAITING_FOR_WRITES, DecodeState, DecodeTransfer


class DecodeTable:
    def __init__(self, finished_memory: int) -> None:
        self.by_id: dict[str, Incoming] = {}
        self.pending: deque[str] = deque()
        self.finished: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.context_states: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._finished_memory = finished_memory

    def remember(
        self, request_id: str, transfer: DecodeTransfer, num_pages_skipped: int = 0
    ) -> None:
        """Record a transfer that ended; ``num_pages_skipped``: the prompt's leading pages the
        decoder had cached, so not transferred (``page_ids`` are the pages after them)."""
        self.finished[request_id] = {
            "imm": transfer.imm,
            "state": transfer.state.value,
            "reason": transfer.failure_reason,
            "num_writes_expected": transfer.num_writes_expected,
            "requested_s": transfer.entered_at(DecodeState.REQUESTED),
            "kv_ready_s": transfer.stats.kv_ready_s,
            "page_ids": list(transfer.page_ids),
            "num_pages_skipped": num_pages_skipped,
        }
        while len(self.finished) > self._finished_memory:
            self.finished.popitem(last=False)

    def keep_context(self, request_id: str, hidden_state: torch.Tensor) -> None:
        self.context_states[request_id] = hidden_state
        while len(self.context_states) > self._finished_memory:
            self.context_states.popitem(last=False)

    def waiting_for_writes(self) -> Iterator[tuple[int, bytes]]:
        """(imm, prefill address) of every transfer whose request went and KV is not all in."""
        for incoming in self.by_id.values():
            transfer = incoming.transfer
            if transfer is not None and transfer.state in WAITING_FOR_WRITES:
                yield transfer.imm, incoming.endpoint.address

    def holding_pages_of(self, address: bytes) -> list[str]:
        """Request ids of the live transfers (pages held) served by the prefill at ``address``."""
        return [
            request_id
            for request_id, incoming in self.by_id.items()
            if incoming.transfer is not None and incoming.endpoint.address == address
        ]

    def count_by_state(self) -> dict[str, int]:
        by_state: dict[str, int] = {}
        for incoming in self.by_id.values():
            name = incoming.transfer.state.value if incoming.transfer else "pending"
            by_state[name] = by_state.get(name, 0) + 1
        return by_state
