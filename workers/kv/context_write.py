"""The context write: the hidden state of a request's last prefilled position, written into the
decoder's context buffer at the end of the request's last pass (the last prompt token's decode
step starts from it, so it is what the decoder waits for last).

Each live transfer owns a row of a registered staging buffer: the hidden state in the engine's
dtype, staged with one ``copy_`` (with the cast) at the pass end, on the path the exposed
transfer time measures; in checksum mode the sums follow it (`workers.kv.checksum`). Rows are
8-aligned. The write goes once its row is staged and (checksum mode) every layer is summed: the
step thread and the push thread each call `ContextWriter.post_if_ready` when their half is
done, under the transfers' lock, and whichever comes second posts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from workers.fabric import FabricError
from workers.kv.checksum import area_bytes
from workers.kv.outgoing import Outgoing
from workers.kv.prefill_side import PrefillSide
from workers.kv.push import CallOutcome

# (transfer, number of writes, their bytes, why): writes counted as submitted, never posted.
NotPosted = Callable[[Outgoing, int, int, FabricError], None]


class ContextWriter:
    def __init__(
        self,
        side: PrefillSide,
        max_transfers: int,
        max_checksum_shards: int,
        *,
        on_done: Callable[[str, int], None],
        on_error: Callable[[str, int, FabricError], None],
        refused: NotPosted,
        unposted: NotPosted,
    ) -> None:
        """``on_done(request_id, 1)`` / ``on_error(request_id, 1, error)``: the write's
        completion (fabric callback thread); ``refused``: the fabric refused it at once (called
        under the lock `post_if_ready` runs under); ``unposted``: it was accepted but never
        posted (callback thread, without the lock)."""
        self._fabric = side.fabric
        self._hidden_bytes = side.hidden_bytes
        row_bytes = self._hidden_bytes + area_bytes(max_checksum_shards)
        self._row_stride = -(-row_bytes // 8) * 8
        self._staging = torch.zeros(max_transfers, self._row_stride, dtype=torch.uint8)
        self._staging_handle, _ = self._fabric.register(self._staging)
        # The hidden-state part of each row in the engine's dtype: staging is one copy_.
        self._staged_hidden = self._staging[:, : self._hidden_bytes].view(side.engine.dtype)
        self._free_rows: deque[int] = deque(range(max_transfers))
        self._on_done = on_done
        self._on_error = on_error
        self._refused = refused
        self._unposted = unposted

    @property
    def has_free_row(self) -> bool:
        return bool(self._free_rows)

    def take_row(self) -> int:
        return self._free_rows.popleft()

    def give_back_row(self, row: int) -> None:
        self._free_rows.append(row)

    def stage(self, out: Outgoing, hidden: torch.Tensor) -> None:
        """Under the lock, at the pass end: copy the request's hidden state into its row."""
        self._staged_hidden[out.context_row].copy_(hidden)
        out.context_staged = True

    def post_if_ready(self, out: Outgoing, now: float) -> None:
        """Under the lock: post the context write once it is staged and (checksum mode) every
        checksum is in."""
        if out.context_sent or not out.context_staged or not out.transfer.accepts_writes:
            return
        if now >= out.deadline_s:
            return  # a prefill worker never submits after the deadline
        checksums = out.checksums
        if checksums is not None and not checksums.complete:
            return
        num_bytes = self._hidden_bytes
        if checksums is not None:
            staged = self._staging[out.context_row].numpy()
            area = checksums.area(staged[: self._hidden_bytes])
            staged[num_bytes : num_bytes + len(area)] = np.frombuffer(area, dtype=np.uint8)
            num_bytes += len(area)
        out.context_sent = True
        self._submit(out, num_bytes, now)

    def _submit(self, out: Outgoing, num_bytes: int, now: float) -> None:
        context = out.checked.context
        assert context is not None
        out.transfer.record_submit(num_bytes, now)
        request_id = out.request.request_id
        outcome = CallOutcome(
            1,
            partial(self._unposted, out),
            lambda count, error: self._on_error(request_id, count, error),
        )
        try:
            self._fabric.submit_write(
                self._staging_handle,
                out.context_row * self._row_stride,
                out.peer,
                context,
                out.request.context_offset,
                num_bytes,
                imm=out.transfer.imm,
                on_done=lambda: self._on_done(request_id, 1),
                on_error=outcome.on_error,
                on_unposted=outcome.on_unposted,
            )
        except FabricError as error:  # refused before queueing: it never left
            self._refused(out, 1, num_bytes, error)
