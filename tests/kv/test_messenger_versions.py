"""Versioned endpoints: a restarted worker is a new peer, never written with
(or asked for) state of its predecessor; every remote id and descriptor is checked on receipt.

- A prefill process restarted at the *same* fabric address (libfabric's tcp port pinned with
  ``FI_TCP_PORT_LOW_RANGE`` / ``_HIGH_RANGE``) publishes a new incarnation: a request built from
  the old endpoint is rejected as stale, one from the new endpoint is served, and the decoder's
  peer cache holds the new incarnation.
- A decoder incarnation new at an address stops the prefill worker's transfers into the old one.
- An endpoint naming another incarnation (unversioned, or one the live worker rejects as stale)
  frees no quarantined page of a live (stopped) prefill worker.
- `check_request` range-checks what a `PrefillRequest` names of the decoder's memory.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from tests.engine.engine_helpers import make_engine, prompts_of_lengths, run_engine
from tests.kv.harness import RemotePrefill, decode_pool_full, prefill_pool_full
from tests.waiting import wait_until
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams
from workers.fabric import MemoryRegionDescriptor
from workers.kv.decode_messenger import DecodeMessengerConfig
from workers.kv.endpoint import PrefillEndpoint
from workers.kv.errors import ProtocolError
from workers.kv.prefill_checks import RequestRejected, check_request
from workers.kv.protocol import PrefillRequest, RejectReason
from workers.service.kv_worker import DecodeWorker, PrefillWorker

PROVIDER = "tcp;ofi_rxm"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
DECODE_PAGES = 200
PREFILL_PAGES = 200
SLOW_PREFILL = {"num_pages": PREFILL_PAGES, "max_num_batched_tokens": 16}

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def decode_pages_free(decode: DecodeWorker) -> bool:
    state = decode.state()
    return state["num_free_pages"] == DECODE_PAGES and state["num_pinned_pages"] == 0


def test_endpoint_carries_its_incarnation() -> None:
    endpoint = PrefillEndpoint(b"\x02" * 16, PROVIDER, 1, 3, False, 8, 16, 0xFEED)
    assert PrefillEndpoint.from_bytes(endpoint.to_bytes()) == endpoint
    raw = msgpack.unpackb(endpoint.to_bytes())
    with pytest.raises(ProtocolError, match="malformed"):
        PrefillEndpoint.from_bytes(msgpack.packb([*raw[:-1], -1]))
    # The unversioned layout of before (8 fields) is another version: refused, not guessed at.
    with pytest.raises(ProtocolError, match="not a version-2"):
        PrefillEndpoint.from_bytes(msgpack.packb([1, *raw[1:-1]]))


@pytest.fixture(scope="module")
def decode(tiny_model_dir: Path) -> Iterator[DecodeWorker]:
    worker = DecodeWorker(
        tiny_model_dir,
        EngineConfig(num_pages=DECODE_PAGES),
        provider=PROVIDER,
        messenger_config=DecodeMessengerConfig(transfer_timeout_s=3.0, drain_interval_s=0.5),
    )
    yield worker
    worker.close()


def test_a_prefill_restarted_at_the_same_address_is_a_new_peer(
    tiny_model_dir: Path, decode: DecodeWorker
) -> None:
    port = str(free_port())
    pinned = {"FI_TCP_PORT_LOW_RANGE": port, "FI_TCP_PORT_HIGH_RANGE": port}
    short, long_prompt = prompts_of_lengths([40, 1600], seed=21)
    (expected,) = run_engine(make_engine(tiny_model_dir), [short], GREEDY)
    first = RemotePrefill(tiny_model_dir, PROVIDER, engine=SLOW_PREFILL, env=pinned)
    second: RemotePrefill | None = None
    try:
        old = first.endpoint
        assert old.incarnation != 0
        assert decode.submit("v1", short, GREEDY, old).result(60)[0] == expected
        assert decode.peer_incarnation(old.address) == old.incarnation

        # Killed mid-transfer; the decoder gives that request up (an AbortPrefill to the dead
        # address, never answered: its pages come back once it is known gone).
        stream = decode.submit("v1-long", long_prompt, GREEDY, old)
        wait_until(
            lambda: (decode.transfer_progress("v1-long") or (0, None))[0] > 0,
            what="first write of v1-long",
        )
        first.kill()
        assert decode.abort("v1-long")
        assert stream.result(30)[1].finish_reason == "abort"

        second = RemotePrefill(tiny_model_dir, PROVIDER, engine=SLOW_PREFILL, env=pinned)
        new = second.endpoint
        assert new.address == old.address, "the restarted worker did not get the same port"
        assert new.incarnation != old.incarnation

        # A request built from the stale registry entry is never served: it fails at the
        # decoder when the AbortPrefill above already failed the old peer, else it reaches the
        # new process (same address), which rejects it. Nothing was written either way.
        tokens, final = decode.submit("stale", short, GREEDY, old).result(30)
        assert tokens == [] and final.finish_reason == "error"
        assert final.error is not None, final
        assert "stale prefill endpoint" in final.error or "has failed" in final.error, final.error
        wait_until(lambda: decode_pages_free(decode), timeout=10, what="decode pool full")

        # The current endpoint is served: the decoder re-resolved the peer under it (whatever
        # it had cached of the old incarnation, a failed state included, is dropped).
        assert decode.submit("v2", short, GREEDY, new).result(60)[0] == expected
        assert decode.peer_incarnation(new.address) == new.incarnation

        # An incarnation the live process does not have reaches it and is rejected as stale.
        forged = dataclasses.replace(new, incarnation=new.incarnation ^ 1)
        tokens, final = decode.submit("forged", short, GREEDY, forged).result(30)
        assert tokens == [] and final.error is not None
        assert "stale prefill endpoint" in final.error, final.error
        assert decode.submit("v2-again", short, GREEDY, new).result(60)[0] == expected
        wait_until(lambda: decode_pages_free(decode), what="decode pool full")
        assert second.state()["num_transfers"] == 0
    finally:
        if not first.killed:
            first.close()
        if second is not None:
            assert second.close() == 0


def test_a_new_decoder_incarnation_stops_transfers_into_the_old_one(
    tiny_model_dir: Path, decode: DecodeWorker
) -> None:
    # Stand-in (named as such): the decoder's incarnation id is changed in place, as a decoder
    # process restarted at the same address would present itself; this test's decoder lives in
    # the test process, whose fabric port cannot be pinned for a second instance.
    prefill = RemotePrefill(tiny_model_dir, PROVIDER, engine=SLOW_PREFILL)
    try:
        short, long_prompt = prompts_of_lengths([40, 1600], seed=22)
        (expected,) = run_engine(make_engine(tiny_model_dir), [short], GREEDY)
        stream = decode.submit("old-life", long_prompt, GREEDY, prefill.endpoint)
        wait_until(
            lambda: (decode.transfer_progress("old-life") or (0, None))[0] > 0,
            what="first write of old-life",
        )

        def restart() -> None:
            decode.messenger.incarnation = random.SystemRandom().getrandbits(64) or 1

        decode._loop.call(restart)
        # The new incarnation's first request: the prefill worker stops the old transfer at
        # once (no write with its descriptors after this) and serves the new one.
        assert decode.submit("new-life", short, GREEDY, prefill.endpoint).result(60)[0] == expected
        stats = prefill.stats("old-life")
        assert stats["state"] == "failed" and "decoder restarted" in stats["reason"], stats
        # (Its decoder "process" is the one gone; here it is aborted so the test ends.)
        assert decode.abort("old-life")
        assert stream.result(30)[1].finish_reason == "abort"
        wait_until(
            lambda: prefill.state()["num_free_pages"] == PREFILL_PAGES, what="prefill pool full"
        )
        assert prefill.state()["num_transfers"] == 0
        wait_until(lambda: decode_pages_free(decode), what="decode pool full")
    finally:
        assert prefill.close() == 0


def test_a_stale_endpoint_frees_no_quarantined_page_of_a_live_prefill(tiny_model_dir: Path) -> None:
    prefill = RemotePrefill(tiny_model_dir, PROVIDER, engine=SLOW_PREFILL)
    decode = DecodeWorker(
        tiny_model_dir,
        EngineConfig(num_pages=DECODE_PAGES),
        provider=PROVIDER,
        messenger_config=DecodeMessengerConfig(transfer_timeout_s=2.0, drain_interval_s=0.5),
    )
    pid = prefill.process.pid or 0
    stopped = False
    try:
        warm, long_prompt, unversioned, forged, after = prompts_of_lengths(
            [40, 1600, 20, 21, 40], seed=13
        )
        expected_warm, expected_after = run_engine(
            make_engine(tiny_model_dir), [warm, after], GREEDY
        )
        endpoint = prefill.endpoint
        assert decode.submit("warm", warm, GREEDY, endpoint).result(60)[0] == expected_warm
        assert decode.peer_incarnation(endpoint.address) == endpoint.incarnation

        # A live prefill process stops mid-transfer: the decoder gives up at its deadline and
        # quarantines the pages, which the stopped process can still write into once resumed.
        stream = decode.submit("A", long_prompt, GREEDY, endpoint)
        wait_until(
            lambda: (decode.transfer_progress("A") or (0, None))[0] > 0, what="first write of A"
        )
        os.kill(pid, signal.SIGSTOP)
        stopped = True
        assert stream.result(30)[1].finish_reason == "error"
        num_held = decode.state()["num_quarantined_pages"]
        assert num_held > 0

        # Requests built from an unversioned endpoint and from one naming an incarnation the
        # live worker does not have, at the same address: neither proves the process gone.
        others = [
            ("unversioned", unversioned, dataclasses.replace(endpoint, incarnation=0)),
            ("forged", forged, dataclasses.replace(endpoint, incarnation=endpoint.incarnation ^ 1)),
        ]
        streams = [decode.submit(rid, prompt, GREEDY, stale) for rid, prompt, stale in others]
        for other in streams:  # both fail at the decoder's deadline (the prefill is stopped)
            assert other.result(30)[1].finish_reason == "error"
        record = dict(decode.transfer_stats("A") or {})
        assert record.get("quarantine_release") is None, record
        assert decode.state()["num_quarantined_pages"] >= num_held
        assert decode.peer_incarnation(endpoint.address) == endpoint.incarnation

        # Resumed, the worker answers the re-sent aborts: pages come back once its writes
        # landed, and the incarnation it rejected as stale was never taken for its own.
        os.kill(pid, signal.SIGCONT)
        stopped = False
        wait_until(lambda: decode_pool_full(decode, DECODE_PAGES), what="decode pool full again")
        assert (decode.transfer_stats("A") or {}).get("quarantine_release") == "drained"
        assert decode.peer_incarnation(endpoint.address) == endpoint.incarnation
        assert decode.submit("after", after, GREEDY, endpoint).result(60)[0] == expected_after
        wait_until(
            lambda: prefill_pool_full(prefill, PREFILL_PAGES), what="prefill pool full again"
        )
        assert decode_pool_full(decode, DECODE_PAGES)
    finally:
        if stopped:
            os.kill(pid, signal.SIGCONT)
        decode.close()
        assert prefill.close() == 0


# --- range checks of what a PrefillRequest names (check_request, on a real prefill worker) -----


@pytest.fixture(scope="module")
def prefill_worker(tiny_model_dir: Path) -> Iterator[PrefillWorker]:
    worker = PrefillWorker(tiny_model_dir, EngineConfig(num_pages=32), provider=PROVIDER)
    yield worker
    worker.close()


def valid_request(worker: PrefillWorker, **changes: Any) -> PrefillRequest:
    messenger = worker.messenger
    geometry = messenger.geometry
    page_bytes = messenger.pools.layout.page_bytes * geometry.num_layers
    num_pages = 16
    pool = MemoryRegionDescriptor(PROVIDER, 0, num_pages * page_bytes, 7, False)
    row_bytes = worker.engine.model_config.hidden_size * worker.engine.kv_cache.element_size()
    context = MemoryRegionDescriptor(PROVIDER, 0, 4 * row_bytes, 8, False)
    fields: dict[str, Any] = {
        "request_id": "r",
        "transfer_id": 1,
        "token_ids": tuple(range(1, 40)),
        "page_size": geometry.page_size,
        "dst_page_ids": ((3, 9, 4),),
        "decode_tp_size": 1,
        "num_kv_heads": messenger.sharding.num_kv_heads,
        "is_mla": False,
        "source_sets": (),
        "coalesce_pages": True,
        "segment_pages": 0,
        "max_pages_per_run": worker.fabric.max_pages_per_run(messenger.pools.layout.page_bytes)
        or 0,
        "dst_descriptors": (pool.to_bytes(),),
        "context_descriptor": context.to_bytes(),
        "context_offset": 3 * row_bytes,
        "expected_write_count": 0,
        "timeout_ms": 5000,
        "prefill_incarnation": messenger.incarnation,
    }
    fields.update(changes)
    return PrefillRequest(**fields)


def rejected(worker: PrefillWorker, request: PrefillRequest) -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        check_request(request, worker.messenger.side, random.Random(0))
    return info.value


def test_every_remote_id_and_descriptor_is_range_checked(prefill_worker: PrefillWorker) -> None:
    worker = prefill_worker
    checked = check_request(valid_request(worker), worker.messenger.side, random.Random(0))
    assert checked.dst_layout.num_pages == 16 and checked.dst_pages == [3, 9, 4]

    row_bytes = worker.engine.model_config.hidden_size * worker.engine.kv_cache.element_size()
    page_bytes = worker.messenger.pools.layout.page_bytes * worker.messenger.geometry.num_layers
    cases: dict[str, tuple[dict[str, Any], str]] = {
        "page id past the pool": ({"dst_page_ids": ((3, 16, 4),)}, "outside the pool"),
        "repeated page id": ({"dst_page_ids": ((3, 9, 3),)}, "repeat"),
        "context row past the buffer": ({"context_offset": 4 * row_bytes}, "context buffer"),
        "pool not whole pages": (
            {
                "dst_descriptors": (
                    MemoryRegionDescriptor(PROVIDER, 0, 16 * page_bytes + 8, 7, False).to_bytes(),
                )
            },
            "whole number",
        ),
        "descriptor of another provider": (
            {
                "dst_descriptors": (
                    MemoryRegionDescriptor("shm", 0, 16 * page_bytes, 7, False).to_bytes(),
                )
            },
            "another provider",
        ),
        "not a descriptor": ({"dst_descriptors": (b"PDMR" + bytes(40),)}, "descriptor"),
        "stale incarnation": (
            {"prefill_incarnation": worker.messenger.incarnation ^ 1},
            "stale prefill endpoint",
        ),
        "a decoder drafting with mtp, this worker without the MTP layer": (
            {"mtp_layers": 1},
            "does not compute (mtp_kv)",
        ),
    }
    free_before = worker.state()["num_free_pages"]
    for name, (changes, message) in cases.items():
        error = rejected(worker, valid_request(worker, **changes))
        assert error.reason is RejectReason.INCOMPATIBLE, name
        assert message in str(error), (name, str(error))
    assert worker.state()["num_free_pages"] == free_before  # nothing allocated
