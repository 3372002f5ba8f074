"""Checksum mode (`workers.kv.checksum`): corrupt KV fails the request instead of decoding.

- The sums: for TP pairs with sharded, replicated and MLA heads, K/V-split and coalesced
  shards, chunked passes and gaps in the page ids, the prefill's per-row sums (the push
  thread's `checksum_layer` over exactly the rows it posts) equal the decoder's per-page sums
  over what landed, with the decoder rebuilding the plan's destination side without knowing the
  prefill's choice of source sets; a flipped byte in a written region fails, one outside does
  not.
- The wire: `PrefillRequest.checksum` is an optional trailing field; off, the request is
  byte-identical to one without the field, and a message without it decodes as off.
- End to end (real prefill process, tcp): checksum mode on gives the colocated engine's greedy
  tokens for TP (1, 1) and (2, 1) with the write count unchanged; the named fault (one source
  byte flipped after it was summed, `PrefillMessengerConfig.fault_flip_after_checksum`: a byte
  corrupted in flight cannot be produced on loopback) fails the request with the checksum error
  and no tokens, both pools come back full, and the same prompt then succeeds; off by default,
  the context write and the decoder's context rows carry no extra bytes.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from orchestrator.config.sections import TransferConfig
from tests.engine.engine_helpers import make_engine, prompts_of_lengths, run_engine
from tests.kv.harness import RemotePrefill
from tests.waiting import wait_until
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams
from workers.kv.checksum import ChecksumAccumulator, area_bytes, max_shards, verify
from workers.kv.decode_messenger import DecodeMessengerConfig
from workers.kv.errors import KVChecksumError, ProtocolError
from workers.kv.pages import sendable_pages
from workers.kv.protocol import PrefillRequest, decode_message, encode_message
from workers.kv.push import build_push_item, checksum_layer
from workers.kv.sharding import GroupSharding, PageGeometry, make_transfer_plan
from workers.kv.writes import PoolLayout, expected_write_count
from workers.service.kv_backends import DecodeBackend
from workers.service.kv_worker import DecodeWorker
from workers.service.metrics import WorkerMetricsExporter

# -- the sums, on synthetic pools -----------------------------------------------------------------

LAYERS, PAGE, HEAD_DIM = 3, 4, 8
SRC_POOL_PAGES, DST_POOL_PAGES = 40, 48


def _pools(layout: PoolLayout, tp: int, rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.integers(0, 256, layout.num_bytes, dtype=np.uint8) for _ in range(tp)]


def _page_ids(num_pages: int, pool_pages: int, rng: random.Random) -> list[int]:
    """Runs with gaps, so that coalescing yields several runs."""
    ids = sorted(rng.sample(range(pool_pages), num_pages))
    return ids


@pytest.mark.parametrize(
    ("p", "d", "heads", "mla"),
    [
        (1, 1, 2, False),
        (2, 1, 2, False),  # reconstruct: K/V-split shards
        (1, 2, 2, False),  # split
        (4, 2, 2, False),  # replicated source: the prefill picks one of 2 source sets
        (2, 4, 2, False),  # replicated destination: 2 destination sets
        (1, 4, 4, False),
        (2, 4, 1, True),  # MLA: each destination rank from a source rank of its own
    ],
)
@pytest.mark.parametrize("coalesce", [True, False])
def test_prefill_sums_equal_decoder_sums(
    p: int, d: int, heads: int, mla: bool, coalesce: bool
) -> None:
    rng = np.random.default_rng(p * 100 + d * 10 + heads)
    pick = random.Random(p + d)
    geometry = PageGeometry(LAYERS, PAGE, HEAD_DIM, 4)
    src_group, dst_group = GroupSharding(p, heads, mla), GroupSharding(d, heads, mla)
    segment = 3
    plan = make_transfer_plan(
        src_group,
        dst_group,
        geometry,
        rng=random.Random(7),
        coalesce_pages=coalesce,
        segment_pages=segment,
    )
    src_layout = PoolLayout.for_group(src_group, geometry, SRC_POOL_PAGES)
    dst_layout = PoolLayout.for_group(dst_group, geometry, DST_POOL_PAGES)
    src_views, dst_views = _pools(src_layout, p, rng), _pools(dst_layout, d, rng)
    num_pages = 11
    src_pages = _page_ids(num_pages, SRC_POOL_PAGES, pick)
    dst_pages = _page_ids(num_pages, DST_POOL_PAGES, pick)
    sums = ChecksumAccumulator(LAYERS, len(plan.shards), num_pages)

    sent = 0
    for done in (3, 7, num_pages):  # three chunked passes; the last sends the rest
        pages = sendable_pages(done, num_pages, sent, segment)
        item = build_push_item(
            "r",
            1,
            None,  # type: ignore[arg-type]  # no fabric: rows are applied by hand below
            (),
            plan,
            src_pages[pages.start : pages.stop],
            dst_pages[pages.start : pages.stop],
            src_layout,
            dst_layout,
            pages.start,
            sums,
        )
        sent = pages.stop
        for layer in range(LAYERS):
            layer_ops = item.layer_ops(layer)
            checksum_layer(item, layer, layer_ops, src_views)
            for src_rank, dst_rank, rows in layer_ops:  # what the NIC does
                for src_at, dst_at, length in rows.tolist():
                    dst_views[dst_rank][dst_at : dst_at + length] = src_views[src_rank][
                        src_at : src_at + length
                    ]
    assert sums.complete and sent == num_pages
    assert len(plan.shards) <= max_shards(dst_group)

    hidden = rng.integers(0, 256, 64, dtype=np.uint8)
    area = np.frombuffer(sums.area(hidden), dtype=np.uint8)
    assert len(area) == area_bytes(len(plan.shards))
    # The decoder's plan: the same destination side whatever source sets the prefill chose.
    num_picks = dst_group.num_replica_sets  # under MLA: one per destination rank
    decoder_plan = make_transfer_plan(src_group, dst_group, geometry, source_sets=(0,) * num_picks)
    verify(decoder_plan, dst_pages, dst_views, dst_layout, hidden, area)

    # A byte outside every written region (a page of no request) changes nothing ...
    untouched = sorted(set(range(DST_POOL_PAGES)) - set(dst_pages))[0]
    dst_views[0][dst_layout.page_offset(1, untouched)] ^= 0xFF
    verify(decoder_plan, dst_pages, dst_views, dst_layout, hidden, area)
    # ... a byte of the last layer's last page on the last destination rank fails it,
    last = dst_layout.page_offset(LAYERS - 1, dst_pages[-1]) + dst_layout.page_bytes - 1
    dst_views[d - 1][last] ^= 0x01
    with pytest.raises(KVChecksumError, match="KV checksum mismatch in 1 of"):
        verify(decoder_plan, dst_pages, dst_views, dst_layout, hidden, area)
    dst_views[d - 1][last] ^= 0x01
    # ... and so does a corrupt hidden state.
    hidden[5] ^= 0x10
    with pytest.raises(KVChecksumError, match="context"):
        verify(decoder_plan, dst_pages, dst_views, dst_layout, hidden, area)


def test_fault_hook_flips_a_summed_byte() -> None:
    """The named fault: the byte flipped after summing reaches the decoder, which sees it."""
    geometry = PageGeometry(LAYERS, PAGE, HEAD_DIM, 4)
    group = GroupSharding(1, 2)
    plan = make_transfer_plan(group, group, geometry, source_sets=(0,))
    layout = PoolLayout.for_group(group, geometry, 8)
    rng = np.random.default_rng(3)
    src_views, dst_views = _pools(layout, 1, rng), _pools(layout, 1, rng)
    sums = ChecksumAccumulator(LAYERS, 1, 2)
    sums.flip_pending = True
    item = build_push_item(
        "r",
        1,
        None,  # type: ignore[arg-type]
        (),
        plan,
        [2, 3],
        [5, 6],
        layout,
        layout,
        0,
        sums,
    )
    for layer in range(LAYERS):
        layer_ops = item.layer_ops(layer)
        checksum_layer(item, layer, layer_ops, src_views)
        for _, _, rows in layer_ops:
            for src_at, dst_at, length in rows.tolist():
                dst_views[0][dst_at : dst_at + length] = src_views[0][src_at : src_at + length]
    assert sums.complete and not sums.flip_pending
    hidden = np.zeros(16, dtype=np.uint8)
    area = np.frombuffer(sums.area(hidden), dtype=np.uint8)
    with pytest.raises(KVChecksumError, match="prefill rank 0 -> decode rank 0"):
        verify(plan, [5, 6], dst_views, layout, hidden, area)


# -- the wire ----------------------------------------------------------------------------------


def _request(**overrides: object) -> PrefillRequest:
    fields: dict[str, object] = {
        "request_id": "r",
        "transfer_id": 5,
        "token_ids": tuple(range(20)),
        "page_size": 16,
        "dst_page_ids": ((3, 4),),
        "decode_tp_size": 1,
        "num_kv_heads": 2,
        "is_mla": False,
        "source_sets": (),
        "coalesce_pages": True,
        "segment_pages": 0,
        "max_pages_per_run": 0,
        "dst_descriptors": (b"d",),
        "context_descriptor": b"c",
        "context_offset": 0,
        "expected_write_count": 0,
        "timeout_ms": 1000,
    }
    fields.update(overrides)
    return PrefillRequest(**fields)  # type: ignore[arg-type]


def test_checksum_field_is_optional_on_the_wire() -> None:
    off, on = _request(), _request(checksum=True)
    raw_off = msgpack.unpackb(encode_message(off))
    raw_on = msgpack.unpackb(encode_message(on))
    assert len(raw_off) == 2 + 17  # what a peer without the field sends and expects
    assert raw_on[: len(raw_off)] == raw_off and raw_on[len(raw_off)] is True
    decoded_off, decoded_on = (
        decode_message(encode_message(off)),
        decode_message(encode_message(on)),
    )
    assert isinstance(decoded_off, PrefillRequest) and isinstance(decoded_on, PrefillRequest)
    assert decoded_off.checksum is False
    assert decoded_on.checksum is True
    with pytest.raises(ProtocolError, match="context descriptor"):
        _request(checksum=True, context_descriptor=b"")
    with pytest.raises(ProtocolError):
        decode_message(msgpack.packb([*raw_off, 1]))  # an int is not a bool


def test_checksum_mode_is_off_by_default() -> None:
    assert DecodeMessengerConfig().checksum is False
    assert TransferConfig().checksum is False
    with pytest.raises(ValueError, match="checksum"):
        TransferConfig(checksum=1)  # type: ignore[arg-type]


# -- end to end: a real prefill process over tcp --------------------------------------------------

PROVIDER = "tcp;ofi_rxm"
BUDGET = 64
PREFILL_PAGES, DECODE_PAGES = 64, 80
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
PAGE_SIZE = 16
LENGTHS = [2, 17, 300]
BAD = "corrupt-me"


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompts_of_lengths(LENGTHS, seed=21)


@pytest.fixture(scope="module")
def colocated(tiny_model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    engine = make_engine(tiny_model_dir, num_pages=DECODE_PAGES, max_num_batched_tokens=BUDGET)
    try:
        return run_engine(engine, prompts, GREEDY)
    finally:
        engine.close()


def _decode(model_dir: Path, checksum: bool) -> DecodeWorker:
    return DecodeWorker(
        model_dir,
        EngineConfig(num_pages=DECODE_PAGES),
        provider=PROVIDER,
        messenger_config=DecodeMessengerConfig(checksum=checksum, drain_interval_s=60.0),
    )


def _prefill_stats(prefill: RemotePrefill, request_id: str) -> dict[str, Any]:
    """The prefill's record of an ended transfer (the decoder may be done before the prefill
    saw its last local completion)."""
    wait_until(lambda: prefill.stats(request_id) is not None, what=f"{request_id} ended")
    return prefill.stats(request_id)


def _pools_full(decode: DecodeWorker, prefill: RemotePrefill) -> None:
    # drain_interval_s is long: pages come back only because every write was accounted for.
    wait_until(lambda: decode.state()["num_free_pages"] == DECODE_PAGES, what="decode pool")
    wait_until(lambda: prefill.state()["num_free_pages"] == PREFILL_PAGES, what="prefill pool")
    assert decode.state()["num_pinned_pages"] == 0 and decode.state()["num_transfers"] == 0
    assert prefill.state()["num_transfers"] == 0


class Cluster:
    """One TP-1 prefill process (with the named fault armed for `BAD`), a decoder in checksum
    mode and one with the default (off), both filled by that prefill worker. The checking one
    is the served decode backend, configured as the cluster config's ``transfer`` section is,
    with its /metrics exporter."""

    def __init__(self, model_dir: Path) -> None:
        self.prefill = RemotePrefill(
            model_dir,
            PROVIDER,
            engine={"num_pages": PREFILL_PAGES, "max_num_batched_tokens": BUDGET},
            messenger={"fault_flip_after_checksum": [BAD]},
            num_threads=1,
        )
        self.backend = DecodeBackend(
            model_dir,
            EngineConfig(num_pages=DECODE_PAGES),
            PROVIDER,
            "127.0.0.1",
            {**TransferConfig(checksum=True).model_dump(), "drain_interval_seconds": 60.0},
        )
        self.checked = self.backend.worker
        self.exporter = WorkerMetricsExporter(self.backend, "decode", str(model_dir))
        self.plain = DecodeWorker(
            model_dir, EngineConfig(num_pages=DECODE_PAGES), provider=PROVIDER
        )

    def checksum_failures(self) -> float:
        self.exporter.refresh()
        labels = {"role": "decode", "model": self.exporter.metrics.model}
        value = self.exporter.registry.get_sample_value(
            "pdserve_kv_checksum_failures_total", labels
        )
        return value or 0.0

    def close(self) -> None:
        self.backend.close()
        self.plain.close()
        assert self.prefill.close() == 0


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path) -> Iterator[Cluster]:
    cluster = Cluster(tiny_model_dir)
    yield cluster
    cluster.close()


@pytest.mark.slow
def test_checksum_mode_keeps_greedy_parity_and_count(
    cluster: Cluster, prompts: list[list[int]], colocated: list[list[int]]
) -> None:
    decode, prefill = cluster.checked, cluster.prefill
    received_before = decode.imm_writes_received()
    streams = [
        decode.submit(f"ok{i}", prompt, GREEDY, prefill.endpoint)
        for i, prompt in enumerate(prompts)
    ]
    results = [stream.result(90) for stream in streams]
    assert [final.error for _, final in results] == [None] * len(prompts)
    assert [tokens for tokens, _ in results] == colocated
    total = 0
    model = decode.engine.model_config
    geometry = PageGeometry(model.num_layers, PAGE_SIZE, model.head_dim, 4)
    group = GroupSharding(1, model.num_kv_heads)
    plan = make_transfer_plan(group, group, geometry, source_sets=(0,), segment_pages=4)
    for i in range(len(prompts)):
        decode_stats, prefill_stats = (
            decode.transfer_stats(f"ok{i}"),
            _prefill_stats(prefill, f"ok{i}"),
        )
        assert decode_stats is not None and decode_stats["state"] == "ready"
        # The count is the one without checksums: the sums ride in the context write.
        expected = expected_write_count(
            plan, prefill_stats["src_pages"], decode_stats["page_ids"], model.num_layers, 1
        )
        assert decode_stats["num_writes_expected"] == expected == prefill_stats["num_writes"]
        total += expected
    wait_until(lambda: decode.imm_writes_received() - received_before >= total)
    assert decode.imm_writes_received() - received_before == total
    assert decode.state()["num_checksum_failures"] == 0
    _pools_full(decode, prefill)


@pytest.mark.slow
def test_corrupt_byte_fails_the_request_and_the_next_succeeds(
    cluster: Cluster, prompts: list[list[int]], colocated: list[list[int]]
) -> None:
    decode, prefill = cluster.checked, cluster.prefill
    prompt = prompts[2]  # several chunked passes
    tokens, final = decode.submit(BAD, prompt, GREEDY, prefill.endpoint).result(90)
    assert tokens == [] and final.finished and final.finish_reason == "error"
    assert final.error is not None and "KV checksum mismatch" in final.error, final.error
    stats = decode.transfer_stats(BAD)
    assert stats is not None and stats["state"] == "failed" and stats["checksum_mismatch"]
    assert decode.state()["num_checksum_failures"] == 1
    assert cluster.checksum_failures() == 1
    # The prefill side saw nothing wrong: every write it posted completed.
    assert _prefill_stats(prefill, BAD)["state"] == "done"
    _pools_full(decode, prefill)

    tokens, final = decode.submit("after", prompt, GREEDY, prefill.endpoint).result(90)
    assert final.error is None and tokens == colocated[2]
    assert decode.state()["num_checksum_failures"] == 1
    assert cluster.checksum_failures() == 1
    _pools_full(decode, prefill)


@pytest.mark.slow
def test_checksum_off_adds_no_bytes(
    cluster: Cluster, prompts: list[list[int]], colocated: list[list[int]]
) -> None:
    """The default decoder against the same prefill worker: its context rows hold the hidden
    state only, the prefill posts no sums (bytes = KV + hidden state) and the count is the
    same; checksum mode adds exactly one area per request to the context write."""
    plain, checked, prefill = cluster.plain, cluster.checked, cluster.prefill
    model = plain.engine.model_config
    hidden_bytes = model.hidden_size * 4
    assert plain.messenger.context.shape[1] == hidden_bytes  # float32 tiny model
    # Checksum mode: each row also holds the largest area any prefill group needs (8-aligned).
    needed = hidden_bytes + area_bytes(max_shards(checked.messenger.sharding))
    assert needed <= checked.messenger.context.shape[1] < needed + 8
    prompt = prompts[1]
    for decode, name in ((plain, "off"), (checked, "on")):
        tokens, final = decode.submit(name, prompt, GREEDY, prefill.endpoint).result(90)
        assert final.error is None and tokens == colocated[1]
    off, on = _prefill_stats(prefill, "off"), _prefill_stats(prefill, "on")
    assert off["num_writes"] == on["num_writes"]
    layout = plain.messenger.pools.layout
    num_pages = len(off["src_pages"])
    assert off["num_bytes"] == model.num_layers * num_pages * layout.page_bytes + hidden_bytes
    assert on["num_bytes"] == off["num_bytes"] + area_bytes(1)  # TP 1:1 is one shard
    _pools_full(plain, prefill)


# -- end to end with resharding: prefill TP 2 -> decode TP 1 --------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_checksum_mode_with_prefill_tp2_decode_tp1(
    tiny_model_dir: Path, prompts: list[list[int]], colocated: list[list[int]]
) -> None:
    """The tiny model's 2 KV heads on 2 prefill ranks, 1 decode rank: each page is rebuilt
    from 2 prefill ranks' K and V writes (4 per page), 2 shards summed on the leader."""
    prefill = RemotePrefill(
        tiny_model_dir,
        PROVIDER,
        engine={
            "num_pages": PREFILL_PAGES,
            "max_num_batched_tokens": BUDGET,
            "tensor_parallel_size": 2,
        },
        num_threads=1,
        daemon=False,  # it spawns its follower rank
    )
    ranks: list[int] = []
    decode: DecodeWorker | None = None
    try:
        ranks = list(prefill.call(op="pids"))
        decode = _decode(tiny_model_dir, checksum=True)
        streams = [
            decode.submit(f"tp{i}", prompt, GREEDY, prefill.endpoint)
            for i, prompt in enumerate(prompts)
        ]
        results = [stream.result(120) for stream in streams]
        assert [final.error for _, final in results] == [None] * len(prompts)
        assert [tokens for tokens, _ in results] == colocated
        stats = _prefill_stats(prefill, "tp2")
        hidden_bytes = decode.engine.model_config.hidden_size * 4
        kv_bytes = stats["num_bytes"] - hidden_bytes - area_bytes(2)
        layout = decode.messenger.pools.layout
        assert kv_bytes == decode.engine.model_config.num_layers * len(stats["src_pages"]) * (
            layout.page_bytes
        )
        assert decode.state()["num_checksum_failures"] == 0
        _pools_full(decode, prefill)
    finally:
        if decode is not None:
            decode.close()
        prefill.close()
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
