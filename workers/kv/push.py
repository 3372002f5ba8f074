"""The push thread: submits each layer's KV writes as soon as the forward pass finished it.

Life cycle of one pass::

    step thread: on_step_scheduled(chunks) ──PassPlan(pass_id, items)──▶ submit_pass:
                 every item's writes of all layers prepared (checked, laid out) ──▶ plan queue
    push thread: take plan ─▶ wait for a LayerProgress update ─▶ layers done since last look
                 ─▶ gate(item, l) for each ─▶ one submit_prepared per rank pair for all of them
                 (repeat until all layers of the pass are sent)

A `PassPlan` names the pass by the id `LayerProgress.begin_pass` will give it (the step thread
is the only writer of the counter, so it knows the next id before the pass starts). A layer of
the plan's pass is sent once the counter shows it done, or as soon as a later pass has begun
or the step thread reported the pass over (`pass_ended`; then the planned pass is over).
Writes of one `PushItem` (a request's sendable pages in this pass) are computed once for layer
0 by `workers.kv.writes.plan_layer_writes`; layer ``l`` adds ``l`` times each pool's layer
stride to the offsets, so every layer posts exactly the writes the plan counts.

Latency (the fixed per-transfer cost, `bench/transfer.py`). The thread sleeps on an event that
the layer counter's listener (`LayerProgress.add_listener`, called by the forward thread after
each layer), `pass_ended` and `close` set, so it reacts to a finished layer or pass at once and
never wakes during the pass for nothing; it polls every ``poll_interval_s`` only for a counter
that cannot notify (`LayerProgress.notifies`: the CUDA one). What the planned pass has not
sent when it ends (all of it in the deferred baseline) is sent by `pass_ended` itself, on the
step thread in the final-norm hook, instead of waking the push thread and waiting for it to
win the GIL from the step thread (both advance the plan under one lock, so each layer is sent
once, by whichever comes first). When several layers are done at
its look (the deferred baseline, or a push thread that fell behind), an item's writes of all
of them go in one `submit_prepared` call per rank pair: one job for the fabric's progress
thread, one GIL-holding stretch of Python instead of one per layer (on CPU the push, step and
fabric threads share the GIL, and each call delayed the fabric's posting). The rows themselves
were checked and laid out before the pass (`TransferEngine.prepare_writes`, rows in layer
order, so layers ``[a, b)`` are one row range): at the moment a layer may go only the queueing
is left. Right after a pass every line of Python runs several times slower than warm, and
preparing ahead took ~0.45 ms off the deferred baseline's 256-token transfer
(bench/history/RESULTS-notebook.md, "Prepared writes").

`gate(item, layer)` (the messenger's, under its lock) decides whether the item's writes of that
layer may still go (transfer not aborted, deadline not passed) and records them as submitted
*before* they are posted, so an abort acknowledgement never undercounts. Completions go to
``on_done`` / ``on_error`` on the fabric's callback thread (with the number of writes of the
call); those only enqueue. Writes the gate let through that the fabric refuses at once (their
preparation failed, or `submit_prepared` raised: queue full, peer failed, engine closed) never
left: they go to ``on_not_posted`` (with their count and bytes) on the thread that tried, so the
gate's owner takes them back out of its submitted count; no decoder may wait for them. So do
writes the fabric accepted but never posted (a failed call's ``on_unposted``, `CallOutcome`).

Several NICs (`workers.kv.nic_lanes`): an item names the source NIC whose engine prepares and
posts its writes (`PushItem.nic`: 0 is the ``engine`` given, 1, 2, ... the ``extra_nics``, each
with every source rank's pool registered with it); its ``peer`` and descriptors are the
destination NIC's, as that engine knows it. One NIC: every item is 0, as before.

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
    PreparedWrites,
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
    # The NIC whose engine posts the writes (`PushThread`'s sources; 0: the primary). ``peer``
    # and ``dst_descriptors`` are the destination as that engine knows it
    # (`workers.kv.nic_lanes`).
    nic: int = 0

    def layer_ops(self, layer: int) -> list[tuple[int, int, np.ndarray]]:
        shift = np.array([layer * self.src_layer_bytes, layer * self.dst_layer_bytes, 0])
        return [(ops.src_rank, ops.dst_rank, ops.rows + shift) for ops in self.ops]

    def layers_rows(self, ops: RankOps, layers: Sequence[int]) -> np.ndarray:
        """``ops``'s rows for each of ``layers`` in turn, as one ``(len(layers) * n, 3)`` array
        (the rows `layer_ops` gives per layer, concatenated)."""
        strides = np.array([self.src_layer_bytes, self.dst_layer_bytes, 0], dtype=np.int64)
        shifts = np.asarray(layers, dtype=np.int64)[:, None] * strides
        return (ops.rows[None, :, :] + shifts[:, None, :]).reshape(-1, 3)


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
    nic: int = 0,
) -> PushItem:
    """The writes of ``src_pages -> dst_pages`` (slices starting at request page
    ``first_page_index``), range-checked against both pools; ``checksums``: checksum mode;
    ``nic``: the source NIC that posts them (`PushItem.nic`)."""
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
        nic,
    )


@dataclass(frozen=True)
class SourceNic:
    """One NIC's engine and every source rank's pool registered with it (rank order)."""

    engine: TransferEngine
    src_handles: tuple[MemoryRegionHandle, ...]


@dataclass
class PassPlan:
    pass_id: int
    items: list[PushItem]


@dataclass
class _Prepared:
    """An item's writes of every layer, prepared before its pass (`PushThread.submit_pass`):
    one `PreparedWrites` per rank pair, the same rows for each layer in layer order; or the
    error preparing them raised, reported when the first layer goes."""

    item: PushItem
    writes: tuple[PreparedWrites, ...] = ()
    error: FabricError | None = None


Gate = Callable[[PushItem, int], bool]
ChecksummedCallback = Callable[[PushItem], None]
DoneCallback = Callable[[str, int], None]
ErrorCallback = Callable[[str, int, FabricError], None]
# (item, number of writes, their bytes, why): gated writes that were never posted.
NotPostedCallback = Callable[[PushItem, int, int, FabricError], None]
# Wait between two looks when the counter notifies: a backstop only (every update, the pass
# end and close all set the event), so no wake-up is lost even if a signal were.
_NOTIFIED_WAIT_S = 0.05


class CallOutcome:
    """The failure callbacks of one submit call of ``count`` counted writes.

    A failed call first reports the writes the fabric never posted (``on_unposted``: they
    waited in its queue when the peer failed, the deadline passed or the engine closed), then
    the failure (``on_error``), which then stands for the posted writes only: ``not_posted``
    gets the first (taken back out of the count: they can never land), ``failed`` the rest
    (skipped when none was posted). Both run on the fabric's callback thread, one after the
    other."""

    def __init__(
        self,
        count: int,
        not_posted: Callable[[int, int, FabricError], None],
        failed: Callable[[int, FabricError], None],
    ) -> None:
        self._count = count
        self._not_posted = not_posted
        self._failed = failed

    def on_unposted(self, count: int, num_bytes: int, error: FabricError) -> None:
        self._count -= count
        self._not_posted(count, num_bytes, error)

    def on_error(self, error: FabricError) -> None:
        if self._count > 0:
            self._failed(self._count, error)


class PushThread:
    """Waits for the layer counter and submits every finished layer's writes of the planned
    pass."""

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
        on_not_posted: NotPostedCallback | None = None,
        extra_nics: Sequence[SourceNic] = (),
    ) -> None:
        """``layerwise=False`` holds every write until `pass_ended` reports the whole pass over
        (the baseline that benchmarks compare the layer-wise push against). ``poll_interval_s``:
        the wait between two looks at a counter that cannot notify (`LayerProgress.notifies`
        False). ``src_views``:
        each source pool as bytes (checksum mode reads them); ``on_checksummed(item)``: the
        item's request has every checksum (called on this thread). ``on_not_posted``: gated
        writes the fabric refused at once (this thread, or the step thread in `pass_ended`);
        None reports them to ``on_error`` instead (for a gate that counts nothing).
        ``extra_nics``: the rank's other NICs, posting the items whose `PushItem.nic` is 1, 2,
        ... (0: ``engine`` and ``src_handles``)."""
        self._sources = (SourceNic(engine, tuple(src_handles)), *extra_nics)
        self._progress = progress
        self._num_layers = num_layers
        self._gate = gate
        self._on_done = on_done
        self._on_error = on_error
        self._poll_interval_s = poll_interval_s
        self._layerwise = layerwise
        self._src_views = tuple(src_views)
        self._on_checksummed = on_checksummed
        self._on_not_posted = on_not_posted
        self._ended_pass_id = 0  # latest pass the step thread reported finished
        self._plans: queue.SimpleQueue[tuple[PassPlan, list[_Prepared]] | None] = (
            queue.SimpleQueue()
        )
        self._stopped = threading.Event()
        # Set by the counter's listener, `pass_ended` and `close`; cleared before each look.
        self._wake = threading.Event()
        self._wait_s = _NOTIFIED_WAIT_S if progress.notifies else poll_interval_s
        # The plan being pushed and its layers sent so far: the push thread advances them and
        # so does `pass_ended` on the step thread, one at a time.
        self._lock = threading.Lock()
        self._current: PassPlan | None = None
        self._prepared: list[_Prepared] = []
        self._sent = 0
        self.num_passes = 0
        self.num_layers_pushed = 0
        self.num_submit_calls = 0
        progress.add_listener(self._wake.set)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit_pass(self, plan: PassPlan) -> None:
        """Queue ``plan`` (step thread, before its pass): each item's writes are checked and
        laid out here for every layer, so a finished layer (and, in the deferred baseline, the
        whole pass) costs only the gate and the queueing at the moment it may go."""
        if plan.items:
            self._plans.put((plan, [self._prepare(item) for item in plan.items]))

    def _prepare(self, item: PushItem) -> _Prepared:
        layers = range(self._num_layers)
        source = self._sources[item.nic]
        try:
            writes = tuple(
                source.engine.prepare_writes(
                    source.src_handles[ops.src_rank],
                    item.peer,
                    item.dst_descriptors[ops.dst_rank],
                    item.layers_rows(ops, layers),
                )
                for ops in item.ops
            )
        except FabricError as error:
            return _Prepared(item, error=error)
        return _Prepared(item, writes)

    def pass_ended(self, pass_id: int) -> bool:
        """The forward pass ``pass_id`` is over (its last op ran). Called on the step thread:
        whatever the planned pass still has to send goes from here at once (no hand-off to
        the push thread, which would first have to wake and win the GIL); then the wake.
        Returns whether it sent any layer."""
        self._ended_pass_id = pass_id
        sent = False
        try:
            with self._lock:
                current = self._current
                if current is not None and current.pass_id <= pass_id:
                    sent = self._advance(current)
        except Exception:  # never into the forward pass; the push thread retries the rest
            log.exception("push at the end of pass %d failed", pass_id)
        self._wake.set()
        return sent

    @property
    def idle(self) -> bool:
        """No pass being pushed and none queued."""
        with self._lock:
            return self._current is None and self._plans.empty()

    def close(self, timeout: float = 10.0) -> None:
        self._progress.remove_listener(self._wake.set)
        self._stopped.set()
        self._wake.set()
        self._plans.put(None)
        self.thread.join(timeout)

    def _run(self) -> None:
        while True:
            entry = self._plans.get()
            if entry is None:
                return
            plan, prepared = entry
            with self._lock:
                self._current, self._prepared, self._sent = plan, prepared, 0
            try:
                self._push_pass(plan)
            except Exception:
                log.exception("push of pass %d failed", plan.pass_id)
            finally:
                with self._lock:
                    self._current, self._prepared = None, []

    def _push_pass(self, plan: PassPlan) -> None:
        while True:
            # Clear before looking: an update after the look sets it again, so the wait below
            # returns at once instead of missing it.
            self._wake.clear()
            with self._lock:
                self._advance(plan)
                if self._sent >= self._num_layers:
                    break
            if self._stopped.is_set():
                return
            self._wake.wait(self._wait_s)
        self.num_passes += 1

    def _advance(self, plan: PassPlan) -> bool:
        """Under ``_lock``: send every layer of ``plan`` done since the last look (True: any)."""
        pass_id, done = self._progress.read()
        if pass_id > plan.pass_id or self._ended_pass_id >= plan.pass_id:
            done = self._num_layers  # the planned pass is over
        elif pass_id < plan.pass_id or not self._layerwise:
            done = 0
        sent = self._sent
        if done <= sent:
            return False
        layers = range(sent, done)
        self._sent = done
        for prepared in self._prepared:
            self._push_item_layers(prepared, layers)
        self.num_layers_pushed += done - sent
        return True

    def _push_item_layers(self, prepared: _Prepared, layers: range) -> None:
        """Gate each of ``layers`` for the item, then queue the writes of those let through:
        one `submit_prepared` per rank pair and run of consecutive layers (checksum mode:
        summed layer by layer before)."""
        item = prepared.item
        allowed = [layer for layer in layers if self._gate(item, layer)]
        if not allowed:
            return
        if item.checksums is not None:
            for layer in allowed:
                self._checksum(item, layer, item.layer_ops(layer))
        for first, last in _runs(allowed):
            num_layers = last - first
            if prepared.error is not None:
                count, num_bytes = item.num_writes * num_layers, item.num_bytes * num_layers
                self._not_posted(item, count, num_bytes, prepared.error)
                continue
            for ops, writes in zip(item.ops, prepared.writes, strict=True):
                per_layer = len(writes) // self._num_layers
                count = per_layer * num_layers
                self.num_submit_calls += 1
                outcome = CallOutcome(
                    count, partial(self._not_posted, item), partial(self._on_error, item.request_id)
                )
                try:
                    self._sources[item.nic].engine.submit_prepared(
                        writes,
                        first * per_layer,
                        last * per_layer,
                        imm=item.imm,
                        on_done=partial(self._on_done, item.request_id, count),
                        on_error=outcome.on_error,
                        on_unposted=outcome.on_unposted,
                    )
                except FabricError as error:  # refused before queueing: none of them left
                    num_bytes = int(ops.rows[:, 2].sum()) * num_layers
                    self._not_posted(item, count, num_bytes, error)

    def _not_posted(self, item: PushItem, count: int, num_bytes: int, error: FabricError) -> None:
        if self._on_not_posted is None:
            self._on_error(item.request_id, count, error)
        else:
            self._on_not_posted(item, count, num_bytes, error)

    def _checksum(
        self, item: PushItem, layer: int, layer_ops: list[tuple[int, int, np.ndarray]]
    ) -> None:
        checksums = item.checksums
        assert checksums is not None
        checksum_layer(item, layer, layer_ops, self._src_views)
        if checksums.complete and self._on_checksummed is not None:
            self._on_checksummed(item)


def _runs(layers: list[int]) -> list[tuple[int, int]]:
    """Ascending ``layers`` as runs ``[first, last)`` of consecutive layers."""
    runs: list[tuple[int, int]] = []
    for layer in layers:
        if runs and runs[-1][1] == layer:
            runs[-1] = (runs[-1][0], layer + 1)
        else:
            runs.append((layer, layer + 1))
    return runs


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
