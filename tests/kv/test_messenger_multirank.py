"""Tensor-parallel transfer path with real engines over synthetic per-rank pools (no model).

For every (prefill TP p, decode TP d) pair and KV head count: the prefill leader (a spawned
process) registers all p rank pools with one engine and pushes the plan's writes with the real
push thread; the decoder registers all d pools with one engine and arms one counter with the
documented formula. Pages must arrive bit-exact, in the right head ranges, and the number of
writes landed must equal the formula.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.kv.harness import SPAWN
from tests.kv.synthetic import geometry_of, logical_kv, rank_slice, synthetic_leader_main
from workers.fabric import TransferEngine
from workers.kv.pools import RegisteredPools
from workers.kv.sharding import GroupSharding, make_transfer_plan
from workers.kv.writes import PoolLayout, expected_write_count

PROVIDERS = ["tcp;ofi_rxm", "shm"]
CASES = [
    (p, d, heads, False) for p, d in [(2, 1), (1, 2), (2, 2), (1, 4), (4, 2)] for heads in (2, 4)
]
# MLA: one latent "head" (one plane) on every rank, each decode rank fed by a source of its own.
CASES += [(4, 2, 1, True), (1, 2, 1, True), (2, 4, 1, True)]
SRC_PAGES = [2, 3, 4, 9, 10, 11, 5]  # two gaps: 3 runs when coalescing
DST_PAGES = [10, 11, 12, 13, 1, 2, 3]


class Leader:
    def __init__(self, provider: str) -> None:
        self.conn, child = SPAWN.Pipe()
        self.process = SPAWN.Process(
            target=synthetic_leader_main, args=(child, provider), daemon=True
        )
        self.process.start()
        child.close()
        assert self.conn.poll(60), "synthetic leader did not start"
        self.address = self.conn.recv_bytes()

    def push(self, case: dict[str, Any]) -> dict[str, Any]:
        self.conn.send_bytes(json.dumps(case).encode())
        assert self.conn.poll(60), "synthetic leader did not answer"
        result: dict[str, Any] = json.loads(self.conn.recv_bytes())
        return result

    def close(self) -> int | None:
        self.conn.send_bytes(b'{"op": "close"}')
        self.process.join(30)
        return self.process.exitcode


@pytest.fixture(scope="module", params=PROVIDERS)
def endpoints(request: pytest.FixtureRequest) -> Iterator[tuple[Leader, TransferEngine]]:
    leader = Leader(str(request.param))
    decoder = TransferEngine(str(request.param))
    yield leader, decoder
    decoder.close()
    assert leader.close() == 0


@pytest.mark.parametrize(("p", "d", "heads", "mla"), CASES)
def test_multirank_pages_bit_exact_and_count(
    endpoints: tuple[Leader, TransferEngine], p: int, d: int, heads: int, mla: bool
) -> None:
    leader, decoder = endpoints
    case: dict[str, Any] = {
        "p": p, "d": d, "heads": heads, "mla": mla, "layers": 3, "page_size": 4, "head_dim": 8,
        "src_num_pages": 16, "dst_num_pages": 20, "seed": 100 * p + 10 * d + heads,
        "segment_pages": 2, "chunk_ends": [4, 7],  # two prefill chunks of 4 and 3 pages
    }  # fmt: skip
    src = GroupSharding(p, heads, mla)
    dst = GroupSharding(d, heads, mla)
    geometry = geometry_of(case)
    plan = make_transfer_plan(src, dst, geometry, rng=random.Random(case["seed"]), segment_pages=2)
    dst_layout = PoolLayout.for_group(dst, geometry, case["dst_num_pages"])
    shape = (3, case["dst_num_pages"], dst.kv_planes, dst.heads_per_rank, 4, 8)
    pools = [np.zeros(shape, dtype=np.float32) for _ in range(d)]
    registered = RegisteredPools.register(decoder, pools, dst_layout)
    # Decode ranks allocate independently: give each rank its own (shifted) page list.
    dst_pages = [[page + rank for page in DST_PAGES] for rank in range(d)]
    expected = expected_write_count(plan, SRC_PAGES, dict(enumerate(dst_pages)), 3, 0)
    imm = 0x1000 + len(case) + 7 * p + d
    landed = threading.Event()
    received_before = decoder.stats().imm.received
    decoder.expect_imm(imm, expected, landed.set)
    result = leader.push(
        {
            **case,
            "source_sets": list(plan.source_sets),
            "src_pages": SRC_PAGES,
            "dst_pages": dst_pages,
            "imm": imm,
            "address": decoder.address.hex(),
            "dst_descriptors": [descriptor.hex() for descriptor in registered.descriptor_bytes()],
        }
    )
    assert result == {"submitted": expected, "done": expected, "failed": 0}
    assert landed.wait(30), "the decoder's counter never reached the formula's count"
    assert decoder.stats().imm.received - received_before == expected

    data = logical_kv(case)[:, SRC_PAGES]
    for rank in range(d):
        want = rank_slice(dst, rank, data)
        np.testing.assert_array_equal(pools[rank][:, dst_pages[rank]], want)
        untouched = np.ones(case["dst_num_pages"], dtype=bool)
        untouched[dst_pages[rank]] = False
        assert not pools[rank][:, untouched].any(), "a write landed outside the request's pages"
    for handle in registered.handles:
        decoder.deregister(handle)
