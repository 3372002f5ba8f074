"""The prefill engine's hooks: where the messenger meets each forward pass.

- `PassHooks.on_step_scheduled` (engine hook, before the pass): every scheduled chunk's sendable
  pages become a `PushItem` of the pass's `PassPlan` for the push thread. Pages go as
  `workers.kv.pages.sendable_pages` allows (whole segments, or the rest after the last chunk),
  so the runs never depend on how the scheduler chunked. A request's last chunk fixes its write
  count and its `PrefillAccepted` goes out: only then are all its source page ids (and so the
  coalesced runs) known; the decoder's counter buffers writes that land before it is armed.
- `PassHooks.on_forward_end` (forward hook of the model's final norm, the pass's last op the
  prefill role needs): requests whose last chunk ran enter WRITING and their context write goes
  (`workers.kv.context_write`), then the pass's KV writes the push thread has not sent yet.
- `PassHooks.after_step` (after the step): a request the engine reports prefilled may be freed
  once its writes drained; one the engine ended otherwise is given up.

All three run on the worker's step thread, the only one touching the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from workers.engine.outputs import RequestOutput
from workers.engine.scheduler import ScheduledChunk
from workers.fabric import PeerHandle
from workers.kv.context_write import ContextWriter
from workers.kv.outgoing import Outgoing
from workers.kv.prefill_side import PrefillSide
from workers.kv.prefill_table import PrefillTable
from workers.kv.protocol import FailReason, Message
from workers.kv.push import PassPlan, PushItem, PushThread
from workers.kv.transfer_state import PrefillState

# Sleep of the step thread after it queued a pass's last writes: long enough for the woken
# fabric progress thread to take the GIL and post them (`on_forward_end`); once per pass.
_HAND_OFF_S = 0.0001


class PassHooks:
    def __init__(
        self,
        side: PrefillSide,
        table: PrefillTable,
        push: PushThread,
        context: ContextWriter,
        *,
        send: Callable[[PeerHandle, Message], None],
        finish_if_drained: Callable[[Outgoing], None],
        give_up: Callable[[Outgoing, FailReason, str], None],
    ) -> None:
        """Installs the hooks on ``side.engine`` (`remove` takes them off)."""
        self._engine = side.engine
        self._side = side
        self._src_layout = side.pools.layout
        self._table = table
        self._push = push
        self._context = context
        self._send = send
        self._finish_if_drained = finish_if_drained
        self._give_up = give_up
        # (request, its row in the pass's hidden states) of each request whose last chunk runs
        # in the current pass: set before the pass, used at its end (`on_forward_end`).
        self._pass_last: list[tuple[Outgoing, int]] = []
        self._engine.on_step_scheduled = self.on_step_scheduled
        self._hook = self._engine.model.norm.register_forward_hook(self.on_forward_end)

    def remove(self) -> None:
        self._hook.remove()
        self._engine.on_step_scheduled = None

    def on_step_scheduled(self, chunks: list[ScheduledChunk]) -> None:
        """Engine hook, before the pass: plan the writes of every chunk's sendable pages."""
        pass_id = self._engine.layer_progress.read()[0] + 1
        items: list[PushItem] = []
        self._pass_last = []
        row = -1  # the chunk's last row in the pass's hidden states
        with self._table.lock:
            for chunk in chunks:
                row += chunk.num_tokens
                out = self._table.by_id.get(chunk.request_id)
                if out is None:
                    continue
                if chunk.end == len(out.request.token_ids):
                    self._pass_last.append((out, row))
                if out.transfer.state is PrefillState.QUEUED:
                    out.transfer.advance(PrefillState.PREFILLING, time.monotonic())
                if not out.src_pages:
                    # The prefill role holds every page of a prompt from its admission; with
                    # prefix caching the first ones come from the cache, in no chunk.
                    pages = self._engine.pages_of(chunk.request_id)
                    out.src_pages = pages[out.skip_pages : out.num_engine_pages]
                if out.transfer.accepts_writes:
                    item, accepted = out.plan_chunk(chunk, self._src_layout)
                    if accepted is not None:
                        self._send(out.peer, accepted)
                    if item is not None:
                        items.append(item)
        self._push.submit_pass(PassPlan(pass_id, items))

    def on_forward_end(self, module: object, args: object, hidden: torch.Tensor) -> None:
        """Forward hook of the model's final norm.

        Requests whose last chunk ran in this pass (`_pass_last`, found before the pass) enter
        WRITING, and their context (the hidden state of the last prefilled position) is staged
        and its write queued at once: it is what the decoder waits for, so nothing else runs
        before it (right after a pass this Python ran ~10x slower than in a warm loop, so every
        line before the post showed in the exposed time; bench/history/RESULTS-notebook.md).
        Then the pass's KV writes the push thread has not sent yet (all of them in the deferred
        baseline; `PushThread.pass_ended`). All on the step thread before the step returns,
        queued with one wake of each NIC's progress thread (`TransferEngine.wakes_deferred`:
        woken by the first, it would start moving bytes and, on CPU, starve this thread of the
        GIL and the cores before the rest is queued), then a short sleep that hands it the GIL,
        so it posts them now instead of after the rest of the step's Python.

        On CUDA the hook runs when the norm is launched, not when it ran: the stream is synced
        first, so that "the pass ended" (and the device's layer word read below, and the
        next pass's id in `on_step_scheduled`) means every layer's KV is in the pages.
        """
        if hidden.is_cuda:
            torch.cuda.current_stream(hidden.device).synchronize()
        now = time.monotonic()
        staged = False
        with self._side.wakes_deferred():  # each NIC's progress thread starts once all is queued
            for out, row in self._pass_last:
                with self._table.lock:
                    out.transfer.stats.forward_end_s = now
                    if out.transfer.state is not PrefillState.PREFILLING:
                        continue
                    out.transfer.advance(PrefillState.WRITING, now)
                    if out.checked.context is None:
                        continue
                    self._context.stage(out, hidden[row])
                    # Checksum mode: posted once the push thread has every sum (there).
                    self._context.post_if_ready(out, now)
                    staged = True
            flushed = self._push.pass_ended(self._engine.layer_progress.read()[0])
        if flushed or staged:
            time.sleep(_HAND_OFF_S)

    def after_step(self, outputs: list[RequestOutput]) -> None:
        """After the step: requests the engine reports prefilled may be freed once drained."""
        table = self._table
        for output in outputs:
            if output.finished and output.request_id in table.engine_ending:
                table.engine_ending.discard(output.request_id)
                continue  # an ended transfer's: a live one with this id is not in the engine
            out = table.by_id.get(output.request_id)
            if out is None:
                continue
            if output.finish_reason == "prefilled":
                out.prefilled = True
                self._finish_if_drained(out)
            elif output.finished and out.active:
                if out.in_engine:  # the engine already ended it: nothing to abort there
                    out.in_engine = False
                    table.reserved_pages -= out.num_engine_pages
                detail = f"engine ended the request ({output.finish_reason})"
                self._give_up(out, FailReason.ENGINE_ERROR, detail)
