"""Child side of the multi-rank transfer tests: a TP group's leader with synthetic KV pools.

The leader maps every rank's pool from shared memory (as TP ranks in separate processes would
hand them over), registers all of them with its one `TransferEngine`, and pushes the planned
writes of each chunk through the real `PushThread`, driving a `LayerProgress` by hand in place
of a model. The pipe carries JSON bytes only.
"""

from __future__ import annotations

import json
import threading
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from tests.waiting import wait_until
from workers.engine.layer_progress import LayerProgress
from workers.fabric import FabricError, MemoryRegionDescriptor, TransferEngine
from workers.kv.pages import sendable_pages
from workers.kv.pools import RegisteredPools
from workers.kv.push import PassPlan, PushItem, PushThread, build_push_item
from workers.kv.sharding import GroupSharding, PageGeometry, make_transfer_plan
from workers.kv.writes import PoolLayout


def logical_kv(case: dict[str, Any]) -> np.ndarray:
    """Every head's KV of every source page: ``[L, pages, planes, H, P, D]`` float32 (seeded);
    one plane (the latent, no V) under MLA."""
    rng = np.random.default_rng(case["seed"])
    shape = (
        case["layers"],
        case["src_num_pages"],
        1 if case["mla"] else 2,
        case["heads"],
        case["page_size"],
        case["head_dim"],
    )
    return rng.standard_normal(shape, dtype=np.float32)


def rank_slice(sharding: GroupSharding, rank: int, data: np.ndarray) -> np.ndarray:
    start = sharding.head_start(rank)
    return data[:, :, :, start : start + sharding.heads_per_rank]


def geometry_of(case: dict[str, Any]) -> PageGeometry:
    return PageGeometry(case["layers"], case["page_size"], case["head_dim"], 4)


def synthetic_leader_main(conn: Connection, provider: str) -> None:
    engine = TransferEngine(provider)
    conn.send_bytes(engine.address)
    try:
        while True:
            command = json.loads(conn.recv_bytes())
            if command.get("op") == "close":
                break
            conn.send_bytes(json.dumps(_push_case(engine, command)).encode())
    finally:
        engine.close()


def _push_case(engine: TransferEngine, case: dict[str, Any]) -> dict[str, Any]:
    src = GroupSharding(case["p"], case["heads"], case["mla"])
    dst = GroupSharding(case["d"], case["heads"], case["mla"])
    geometry = geometry_of(case)
    layout = PoolLayout.for_group(src, geometry, case["src_num_pages"])
    data = logical_kv(case)
    segments: list[shared_memory.SharedMemory] = []
    try:
        pools = []
        for rank in range(src.tp_size):
            segment = shared_memory.SharedMemory(create=True, size=layout.num_bytes)
            segments.append(segment)
            pool = np.ndarray(
                (
                    layout.num_layers,
                    layout.num_pages,
                    layout.kv_planes,
                    layout.kv_heads_local,
                    layout.page_size,
                    layout.head_dim,
                ),
                dtype=np.float32,
                buffer=segment.buf,
            )
            pool[...] = rank_slice(src, rank, data)
            pools.append(pool)
        registered = RegisteredPools.register(engine, pools, layout)
        result = _push(engine, registered, case, src, dst, geometry)
        for handle in registered.handles:
            engine.deregister(handle)
        del pools
        return result
    finally:
        for segment in segments:
            segment.close()
            segment.unlink()


def _push(
    engine: TransferEngine,
    registered: RegisteredPools,
    case: dict[str, Any],
    src: GroupSharding,
    dst: GroupSharding,
    geometry: PageGeometry,
) -> dict[str, Any]:
    plan = make_transfer_plan(
        src, dst, geometry, source_sets=case["source_sets"], segment_pages=case["segment_pages"]
    )
    descriptors = tuple(
        MemoryRegionDescriptor.from_bytes(bytes.fromhex(d)) for d in case["dst_descriptors"]
    )
    dst_layout = PoolLayout.for_group(dst, geometry, case["dst_num_pages"])
    peer = engine.add_peer(bytes.fromhex(case["address"]))
    lock = threading.Condition()
    counts = {"submitted": 0, "done": 0, "failed": 0}

    def gate(item: PushItem, layer: int) -> bool:
        with lock:
            counts["submitted"] += item.num_writes
        return True

    def done(request_id: str, count: int) -> None:
        with lock:
            counts["done"] += count
            lock.notify_all()

    def failed(request_id: str, count: int, error: FabricError) -> None:
        with lock:
            counts["failed"] += count
            lock.notify_all()

    progress = LayerProgress(geometry.num_layers)
    push = PushThread(engine, registered.handles, progress, geometry.num_layers, gate, done, failed)
    src_pages, dst_pages = case["src_pages"], case["dst_pages"]
    sent = 0
    num_passes = 0
    try:
        for end_page in case["chunk_ends"]:
            pages = sendable_pages(end_page, len(src_pages), sent, case["segment_pages"])
            sent = pages.stop
            items = []
            if pages:
                items.append(
                    build_push_item(
                        "synthetic",
                        case["imm"],
                        peer,
                        descriptors,
                        plan,
                        src_pages[pages.start : pages.stop],
                        {r: ids[pages.start : pages.stop] for r, ids in enumerate(dst_pages)},
                        registered.layout,
                        dst_layout,
                        pages.start,
                    )
                )
            num_passes += bool(items)  # the push thread skips plans without items
            push.submit_pass(PassPlan(progress.read()[0] + 1, items))
            progress.begin_pass()  # a model's forward pass, layer by layer
            for layer in range(geometry.num_layers):
                progress.mark_layer_done(layer)

        def all_sent() -> bool:
            with lock:
                return (
                    push.num_passes == num_passes
                    and counts["done"] + counts["failed"] >= counts["submitted"]
                )

        wait_until(all_sent, timeout=30, what="every pass pushed and every write completed")
    finally:
        push.close()
    return dict(counts)
