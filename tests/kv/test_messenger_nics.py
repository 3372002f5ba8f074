"""Workers with two NICs each (`workers.fabric.nics`, `workers.kv.nic_lanes`), real engines on
the tiny preset over ``tcp``: the loopback addresses 127.0.0.2 and 127.0.0.3 stand in for the
two NICs of each side.

- Requests in turn take both NIC pairs: every byte of their KV arrives (checksum mode verifies
  each shard against the prefill's sums), outputs equal the colocated engine's, each of the
  decoder's NICs counted its share of the writes under the requests' one counters, both of the
  prefill worker's NICs posted writes, every control message carried the cluster's MAC, and
  both pools are full again.
- Aborting a transfer mid-way on each NIC pair frees everything on both sides.
- A prefill process killed while a request's KV moves through the second NICs is noticed
  through its primary address: the request fails long before its deadline and its pages come
  back.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.engine_helpers import make_engine, prompts_of_lengths, run_engine
from tests.kv.harness import RemotePrefill, decode_pool_full, wait_pools_full
from tests.waiting import wait_until
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams
from workers.kv.decode_messenger import DecodeMessengerConfig
from workers.kv.endpoint import PrefillEndpoint
from workers.kv.prefill_messenger import PrefillMessengerConfig
from workers.service.kv_worker import DecodeWorker, PrefillWorker

PROVIDER = "tcp;ofi_rxm"
NICS = ("127.0.0.2", "127.0.0.3")
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
DECODE_PAGES = 320
PREFILL_PAGES = 320
SECRET = secrets.token_bytes(32)
# One page per prefill pass: a long prompt takes ~100 passes, time to act mid-transfer.
SLOW_PREFILL = {"num_pages": PREFILL_PAGES, "max_num_batched_tokens": 16}

pytestmark = pytest.mark.slow


def decode_worker(model_dir: Path, **config: object) -> DecodeWorker:
    return DecodeWorker(
        model_dir,
        EngineConfig(num_pages=DECODE_PAGES),
        provider=PROVIDER,
        nics=NICS,
        messenger_config=DecodeMessengerConfig(secret=SECRET, **config),  # type: ignore[arg-type]
    )


def landed_per_nic(worker: DecodeWorker) -> list[int]:
    return [stats.progress.imm_writes_received for stats in worker.nics.stats()]


def posted_per_nic(worker: PrefillWorker) -> list[int]:
    return [stats.progress.ops_posted for stats in worker.nics.stats()]


def wait_for_landed_writes(decode: DecodeWorker, request_id: str) -> None:
    def landed() -> bool:
        progress = decode.transfer_progress(request_id)
        assert progress is not None, "the transfer ended before it could be interrupted"
        return progress[0] > 0

    wait_until(landed, what=f"first write of {request_id}")


@pytest.fixture
def prefill(tiny_model_dir: Path) -> Iterator[PrefillWorker]:
    worker = PrefillWorker(
        tiny_model_dir,
        EngineConfig(**SLOW_PREFILL),  # type: ignore[arg-type]
        provider=PROVIDER,
        nics=NICS,
        messenger_config=PrefillMessengerConfig(secret=SECRET),
    )
    yield worker
    worker.close(drain_timeout_s=2.0)


def test_requests_take_both_nic_pairs_and_arrive_intact(
    prefill: PrefillWorker, tiny_model_dir: Path
) -> None:
    assert prefill.fabric.address == prefill.endpoint().address  # the primary is advertised
    prompts = prompts_of_lengths([40, 70, 33, 90], seed=3)
    expected = run_engine(make_engine(tiny_model_dir), prompts, GREEDY)
    decode = decode_worker(tiny_model_dir, checksum=True)
    try:
        before = landed_per_nic(decode)
        results = []
        for i, prompt in enumerate(prompts):  # one at a time: each takes the next NIC pair
            stream = decode.submit(f"n{i}", prompt, GREEDY, prefill.endpoint())
            results.append(stream.result(60))
        assert [final.error for _, final in results] == [None] * len(prompts)
        assert [tokens for tokens, _ in results] == expected
        state = decode.state()
        assert state["num_checksum_failures"] == 0
        assert state["num_unauthenticated_messages"] == 0
        assert prefill.state()["num_unauthenticated_messages"] == 0
        # Every write counted, on whichever NIC it landed; each NIC carried some.
        landed = [now - then for now, then in zip(landed_per_nic(decode), before, strict=True)]
        records = [decode.transfer_stats(f"n{i}") or {} for i in range(len(prompts))]
        assert sum(landed) == sum(record["num_writes_expected"] for record in records)
        assert all(count > 0 for count in landed), landed
        assert all(count > 0 for count in posted_per_nic(prefill)), posted_per_nic(prefill)
        wait_pools_full(prefill, decode, prefill_pages=PREFILL_PAGES, decode_pages=DECODE_PAGES)
    finally:
        decode.close()


def test_aborts_mid_transfer_on_both_nic_pairs_release_everything(
    prefill: PrefillWorker, tiny_model_dir: Path
) -> None:
    decode = decode_worker(tiny_model_dir)
    try:
        prompts = prompts_of_lengths([1600, 1600], seed=4)
        # One after the other (the prefill engine runs the first before the second anyway):
        # consecutive requests take the two NIC pairs, so each is aborted mid-way on its own.
        for i, prompt in enumerate(prompts):
            stream = decode.submit(f"a{i}", prompt, GREEDY, prefill.endpoint())
            wait_for_landed_writes(decode, f"a{i}")
            assert decode.abort(f"a{i}")
            assert stream.result(30)[1].finish_reason == "abort"
        assert all(count > 0 for count in landed_per_nic(decode)), landed_per_nic(decode)
        wait_pools_full(prefill, decode, prefill_pages=PREFILL_PAGES, decode_pages=DECODE_PAGES)
        assert decode.state()["num_quarantined_pages"] == 0
        for i in range(len(prompts)):
            assert (prefill.transfer_stats(f"a{i}") or {})["state"] == "cancelled"
            # Freed once the acknowledged number of writes had landed, on either NIC.
            assert (decode.transfer_stats(f"a{i}") or {})["quarantine_release"] == "drained"
        # A later request reuses the freed pages and slots and decodes correctly.
        (later,) = prompts_of_lengths([60], seed=5)
        (want,) = run_engine(make_engine(tiny_model_dir), [later], GREEDY)
        tokens, final = decode.submit("after", later, GREEDY, prefill.endpoint()).result(60)
        assert tokens == want, final.error
    finally:
        decode.close()


def steer_to_second_pair(decode: DecodeWorker, endpoint: PrefillEndpoint) -> None:
    """Serve short requests until one went through the primary NIC pair (none of its page
    writes landed on the decoder's second NIC): the next request takes the second pair."""
    for i, prompt in enumerate(prompts_of_lengths([40, 40], seed=7)):
        before = landed_per_nic(decode)[1]
        _, final = decode.submit(f"steer{i}", prompt, GREEDY, endpoint).result(60)
        assert final.error is None, final.error
        if landed_per_nic(decode)[1] == before:
            return
    raise AssertionError("two requests in a row took the second NIC pair")


def test_a_killed_prefill_with_two_nics_is_noticed_and_frees_everything(
    tiny_model_dir: Path,
) -> None:
    prefill = RemotePrefill(
        tiny_model_dir,
        PROVIDER,
        engine=SLOW_PREFILL,
        nics=NICS,
    )
    decode = DecodeWorker(
        tiny_model_dir,
        EngineConfig(num_pages=DECODE_PAGES),
        provider=PROVIDER,
        nics=NICS,
        # Deadlines an hour away: only the liveness check can end the requests in time.
        messenger_config=DecodeMessengerConfig(transfer_timeout_s=3600.0, drain_interval_s=3600.0),
    )
    try:
        # Its KV moves through the second NICs only: the decoder's liveness check still
        # watches the primary address, the one the endpoint names.
        steer_to_second_pair(decode, prefill.endpoint)
        (prompt,) = prompts_of_lengths([1600], seed=6)
        stream = decode.submit("k", prompt, GREEDY, prefill.endpoint)
        second_before = landed_per_nic(decode)[1]
        wait_for_landed_writes(decode, "k")
        assert landed_per_nic(decode)[1] > second_before
        prefill.kill()
        tokens, final = stream.result(60)
        assert tokens == [] and final.error is not None
        assert "prefill worker gone" in final.error, final.error
        wait_until(lambda: decode_pool_full(decode, DECODE_PAGES), what="decode pool full again")
        assert (decode.transfer_stats("k") or {})["quarantine_release"] == "peer_gone"
    finally:
        decode.close()
        prefill.close()
