"""The push thread: submits each layer's KV writes as soon as the forward pass finished it.

Life cycle of one pass::

    step thread: on_step_scheduled(chunks) ──PassPlan(pass_id, items)──▶ plan queue
    push thread: take plan ─▶ poll LayerProgress ─▶ layer l done ─▶ gate(item, l) ─▶ submit_writes
                                                    (repeat until all layers of the pass are sent)

A `PassPlan` names the pass by the id `LayerProgress.begin_pass` will give it (the step thread
is the only writer of the counter, so it knows the next id before the pass starts). A layer of
the plan's pass is sent once the counter shows it done, or as soon as a later pass has begun
(then the planned pass is over). Writes of one `PushItem` (a request's sendable pages in this
pass) are computed once for layer 0 by `workers.kv.writes.plan_layer_writes`; layer ``l`` adds
``l`` times each pool's layer stride to the offsets, so every layer posts exactly the writes
the plan counts.

`gate(item, layer)` (the messenger's, under its lock) decides whether the item's writes of that
layer may still go (transfer not aborted, deadline not passed) and records them as submitted
*before* they are posted, so an abort acknowledgement never undercounts. Completions go to
``on_done`` / ``on_error`` on the fabric's callback thread; those only enqueue.

Checksum mode (`workers.kv.checksum`): an item of a request that asked for it carries the
request's `ChecksumAccumulator`; right after the gate let a layer go and before its writes are
posted, the push thread streams the source bytes of each rank pair's rows into that layer's CRC
of the pair's shard, and once every layer of every page is summed it calls ``on_checksummed``
(the messenger then posts the context write, which carries the sums).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from workers.engine.layer_progress import LayerProgress
from workers.fabric import (
    FabricError,
    MemoryRegionDescriptor,
    MemoryRegionHandle,
    PeerHandle,
    TransferEngine,
)
from workers.kv.checksum import ChecksumAccumulator, shard_order
from workers.kv.sharding import TransferPlan
from workers.kv.writes import PageIds, PoolLayout, pages_of_rank, plan_layer_writes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankOps:
    """Writes of one layer from one source rank's pool to one destination rank's pool."""

    src_rank: int
    dst_rank: int
    rows: np.ndarray  # int64 rows (src_offset, dst_offset, length) for layer 0


@dataclass(frozen=True)
class PushItem:
    """One request's pages sent in one pass: the same writes for every layer."""

    request_id: str
    imm: int
    peer: PeerHandle
    dst_descriptors: tuple[MemoryRegionDescriptor, ...]
    ops: tuple[RankOps, ...]
    src_layer_bytes: int  # stride between two layers of a source pool
    dst_layer_bytes: int
    num_writes: int  # per layer
    num_bytes: int  # per layer
    num_pages: int = 0  # request pages this item sends
    checksums: ChecksumAccumulator | None = None  # checksum mode: the request's sums
    shards: tuple[int, ...] = ()  # checksum mode: plan shard index of each of ``ops``

    def layer_ops(self, layer: int) -> list[tuple[int, int, np.ndarray]]:
        shift = np.array([layer * self.src_layer_bytes, layer * self.dst_layer_bytes, 0])
        return [(ops.src_rank, ops.dst_rank, ops.rows + shift) for ops in self.ops]


def build_push_item(
    request_id: str,
    imm: int,
    peer: PeerHandle,
    dst_descriptors: tuple[MemoryRegionDescriptor, ...],
    plan: TransferPlan,
    src_pages: PageIds,
    dst_pages: PageIds,
    src_layout: PoolLayout,
    dst_layout: PoolLayout,
    first_page_index: int,
    checksums: ChecksumAccumulator | None = None,
) -> PushItem:
    """The writes of ``src_pages -> dst_pages`` (slices starting at request page
    ``first_page_index``), range-checked against both pools; ``checksums``: checksum mode."""
    writes = plan_layer_writes(
        plan, 0, src_pages, dst_pages, src_layout, dst_layout, first_page_index=first_page_index
    )
    groups: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for write in writes:
        key = (write.src_rank, write.dst_rank)
        groups.setdefault(key, []).append((write.src_offset, write.dst_offset, write.length))
    ops = tuple(
        RankOps(src, dst, np.asarray(rows, dtype=np.int64)) for (src, dst), rows in groups.items()
    )
    shards: tuple[int, ...] = ()
    if checksums is not None:
        pairs = shard_order(plan)
        shards = tuple(pairs.index((op.src_rank, op.dst_rank)) for op in ops)
    return PushItem(
        request_id,
        imm,
        peer,
        dst_descriptors,
        ops,
        src_layout.num_pages * src_layout.page_bytes,
        dst_layout.num_pages * dst_layout.page_bytes,
        len(writes),
        sum(write.length for write in writes),
        len(pages_of_rank(dst_pages, plan.shards[0].dst_rank)) if plan.shards else 0,
        checksums,
        shards,
    )


@dataclass
class PassPlan:
    pass_id: int
    items: list[PushItem]


Gate = Callable[[PushItem, int], bool]
ChecksummedCallback = Callable[[PushItem], None]
DoneCallback = Callable[[str, int], None]
ErrorCallback = Callable[[str, int, FabricError], None]


class PushThread:
    """Polls the layer counter and submits every finished layer's writes of the planned pass."""

    def __init__(
        self,
        engine: TransferEngine,
        src_handles: Sequence[MemoryRegionHandle],
        progress: LayerProgress,
        num_layers: int,
        gate: Gate,
        on_done: DoneCallback,
        on_error: ErrorCallback,
        *,
        poll_interval_s: float = 0.0001,
        layerwise: bool = True,
        name: str = "kv-push",
        src_views: Sequence[np.ndarray] = (),
        on_checksummed: ChecksummedCallback | None = None,
    ) -> None:
        """``layerwise=False`` holds every write until `pass_ended` reports the whole pass over
        (the baseline that benchmarks compare the layer-wise push against). ``src_views``:
        each source pool as bytes (checksum mode reads them); ``on_checksummed(item)``: the
        item's request has every checksum (called on this thread)."""
        self._engine = engine
        self._src_handles = tuple(src_handles)
        self._progress = progress
        self._num_layers = num_layers
        self._gate = gate
        self._on_done = on_done
        self._on_error = on_error
        self._poll_interval_s = poll_interval_s
        self._layerwise = layerwise
        self._src_views = tuple(src_views)
        self._on_checksummed = on_checksummed
        self._ended_pass_id = 0  # latest pass the step thread reported finished
        self._plans: queue.SimpleQueue[PassPlan | None] = queue.SimpleQueue()
        self._stopped = threading.Event()
        self.num_passes = 0
        self.num_layers_pushed = 0
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit_pass(self, plan: PassPlan) -> None:
        if plan.items:
            self._plans.put(plan)

    def pass_ended(self, pass_id: int) -> None:
        """The forward pass ``pass_id`` is over (its last op ran); one store, no lock."""
        self._ended_pass_id = pass_id

    def close(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self._plans.put(None)
        self.thread.join(timeout)

    def _run(self) -> None:
        while True:
            plan = self._plans.get()
            if plan is None:
                return
            try:
                self._push_pass(plan)
            except Exception:
                log.exception("push of pass %d failed", plan.pass_id)

    def _push_pass(self, plan: PassPlan) -> None:
        sent = 0
        while sent < self._num_layers:
            pass_id, done = self._progress.read()
            if pass_id > plan.pass_id or self._ended_pass_id >= plan.pass_id:
                done = self._num_layers  # the planned pass is over
            elif pass_id < plan.pass_id or not self._layerwise:
                done = 0
            if done <= sent:
                if self._stopped.is_set():
                    return
                time.sleep(self._poll_interval_s)
                continue
            for layer in range(sent, done):
                for item in plan.items:
                    self._push_item_layer(item, layer)
                self.num_layers_pushed += 1
            sent = done
        self.num_passes += 1

    def _push_item_layer(self, item: PushItem, layer: int) -> None:
        if not self._gate(item, layer):
            return
        layer_ops = item.layer_ops(layer)
        if item.checksums is not None:
            self._checksum(item, layer, layer_ops)
        for src_rank, dst_rank, rows in layer_ops:
            count = int(rows.shape[0])
            try:
                self._engine.submit_writes(
                    self._src_handles[src_rank],
                    item.peer,
                    item.dst_descriptors[dst_rank],
                    rows,
                    imm=item.imm,
                    on_done=partial(self._on_done, item.request_id, count),
                    on_error=partial(self._on_error, item.request_id, count),
                )
            except FabricError as error:
                self._on_error(item.request_id, count, error)

    def _checksum(
        self, item: PushItem, layer: int, layer_ops: list[tuple[int, int, np.ndarray]]
    ) -> None:
        checksums = item.checksums
        assert checksums is not None
        checksum_layer(item, layer, layer_ops, self._src_views)
        if checksums.complete and self._on_checksummed is not None:
            self._on_checksummed(item)


def checksum_layer(
    item: PushItem,
    layer: int,
    layer_ops: list[tuple[int, int, np.ndarray]],
    src_views: Sequence[np.ndarray],
) -> None:
    """Checksum mode, before ``layer_ops`` (``item.layer_ops(layer)``) are posted: stream the
    source bytes of each rank pair's rows into its shard's CRC of ``layer``."""
    checksums = item.checksums
    assert checksums is not None
    for shard, (src_rank, _, rows) in zip(item.shards, layer_ops, strict=True):
        checksums.add(layer, shard, src_views[src_rank], rows)
    if checksums.flip_pending and layer_ops:
        # NAMED TEST FAULT (`PrefillMessengerConfig.fault_flip_after_checksum`): a byte
        # corrupted in flight cannot be produced on a loopback fabric, so one source byte is
        # flipped after it was summed and before it is posted.
        checksums.flip_pending = False
        src_rank, _, rows = layer_ops[0]
        src_views[src_rank][int(rows[0, 0])] ^= 0xFF
    checksums.pages_done(item.num_pages)
