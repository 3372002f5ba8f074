"""Prefix caching across the transfer: a decoder that still holds a conversation's earlier
pages asks only for the pages after them, and a prefill worker that has a prefix cached does not
compute it again (it still sends every page the decoder lacks).

Real fabric (tcp;ofi_rxm), a prefill worker process, two in-process decoders. Every answer must
equal the plain colocated engine's (no caching anywhere); the decoder's counter must expect
exactly the writes of the pages after the skipped ones (README's formula over those pages);
every pool must be full again (cached pages count as free).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.engine_helpers import make_engine, prompts_of_lengths, run_engine
from tests.kv.harness import RemotePrefill
from tests.kv.test_messenger_parity import formula_count
from tests.waiting import wait_until
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams
from workers.kv.pages import num_pages_for_tokens
from workers.service.kv_worker import DecodeWorker

PROVIDER = "tcp;ofi_rxm"
PAGE = 16
BUDGET = 64  # 4-page chunks: the prompts take several passes
PREFILL_PAGES = 96
DECODE_PAGES = 120
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)

pytestmark = pytest.mark.slow


class Cluster:
    def __init__(self, model_dir: Path) -> None:
        self.prefill = RemotePrefill(
            model_dir,
            PROVIDER,
            engine={
                "num_pages": PREFILL_PAGES,
                "max_num_batched_tokens": BUDGET,
                "enable_prefix_caching": True,
            },
        )
        caching = EngineConfig(num_pages=DECODE_PAGES, enable_prefix_caching=True)
        self.decoders = [DecodeWorker(model_dir, caching, provider=PROVIDER) for _ in range(2)]

    def ask(self, decoder: int, request_id: str, prompt: list[int]) -> list[int]:
        stream = self.decoders[decoder].submit(request_id, prompt, GREEDY, self.prefill.endpoint)
        tokens, final = stream.result(60)
        assert final.error is None, final.error
        return tokens

    def assert_pools_full(self) -> None:
        for decoder in self.decoders:
            wait_until(
                lambda d=decoder: d.state()["num_free_pages"] == DECODE_PAGES,  # type: ignore[misc]
                what="decode pool full",
            )
            state = decoder.state()
            assert state["num_pinned_pages"] == state["num_transfers"] == 0
        wait_until(
            lambda: self.prefill.state()["num_free_pages"] == PREFILL_PAGES,
            what="prefill pool full",
        )
        assert self.prefill.state()["num_transfers"] == 0

    def close(self) -> None:
        for decoder in self.decoders:
            decoder.close()
        assert self.prefill.close() == 0


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path) -> Iterator[Cluster]:
    cluster = Cluster(tiny_model_dir)
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> Iterator[object]:
    yield make_engine(tiny_model_dir)


def reference(plain: object, prompt: list[int]) -> list[int]:
    return run_engine(plain, [prompt], GREEDY)[0]  # type: ignore[arg-type]


def check_transfer(cluster: Cluster, decoder: int, request_id: str, prompt: list[int]) -> int:
    """The transfer wrote exactly the pages after the skipped ones; returns how many it skipped."""
    record = cluster.decoders[decoder].transfer_stats(request_id)
    assert record is not None and record["state"] == "ready", record
    skipped = record["num_pages_skipped"]
    total = num_pages_for_tokens(len(prompt) - 1, PAGE)
    assert len(record["page_ids"]) == total - skipped
    prefill_stats = cluster.prefill.stats(request_id)
    assert prefill_stats["state"] == "done"
    expected = formula_count(
        prefill_stats["src_pages"], record["page_ids"], cluster.prefill.endpoint.segment_pages
    )
    assert record["num_writes_expected"] == expected
    assert prefill_stats["num_writes"] == prefill_stats["num_writes_planned"] == expected
    return int(skipped)


def test_a_second_turn_on_the_same_decoder_sends_only_the_new_pages(
    cluster: Cluster, plain: object
) -> None:
    system, question, follow_up = prompts_of_lengths([70, 21, 30], seed=11)
    turn1 = system + question
    answer = cluster.ask(0, "t1", turn1)
    assert answer == reference(plain, turn1)
    assert check_transfer(cluster, 0, "t1", turn1) == 0

    # The decoder computed the answer's KV itself: its full pages are named too, so the second
    # turn skips every full page of the first turn's tokens but the last sampled one's.
    turn2 = turn1 + answer + follow_up
    counted_before = cluster.decoders[0].state()
    hits_before = cluster.prefill.state()["num_prefix_cache_hits"]
    assert cluster.ask(0, "t2", turn2) == reference(plain, turn2)
    held = (len(turn1) + len(answer) - 1) // PAGE
    assert check_transfer(cluster, 0, "t2", turn2) == held
    # What the decoder's metrics export (`pdserve_kv_transfer_pages_total`).
    counted = cluster.decoders[0].state()
    assert counted["num_pages_skipped"] - counted_before["num_pages_skipped"] == held
    written = num_pages_for_tokens(len(turn2) - 1, PAGE) - held
    assert counted["num_pages_requested"] - counted_before["num_pages_requested"] == written
    # The prefill worker had the first turn's prompt pages cached: it computed only the rest.
    hits = cluster.prefill.state()["num_prefix_cache_hits"] - hits_before
    assert hits == (len(turn1) - 1) // PAGE * PAGE

    # The same second turn on the other decoder, which holds nothing: every page is written
    # (from the prefill worker's cache where it has them).
    assert cluster.ask(1, "t2-elsewhere", turn2) == reference(plain, turn2)
    assert check_transfer(cluster, 1, "t2-elsewhere", turn2) == 0
    cluster.assert_pools_full()


def test_a_prompt_whose_kv_is_all_cached_needs_no_transfer(cluster: Cluster, plain: object) -> None:
    prompt = prompts_of_lengths([3 * PAGE + 1], seed=12)[0]  # its KV: exactly 3 full pages
    assert cluster.ask(0, "whole-1", prompt) == reference(plain, prompt)
    assert check_transfer(cluster, 0, "whole-1", prompt) == 0
    written_before = cluster.decoders[0].imm_writes_received()
    assert cluster.ask(0, "whole-2", prompt) == reference(plain, prompt)
    assert cluster.decoders[0].transfer_stats("whole-2") is None  # nothing asked of prefill
    assert cluster.decoders[0].imm_writes_received() == written_before
    cluster.assert_pools_full()


def test_aborting_one_sharer_leaves_the_shared_pages_to_the_other(
    cluster: Cluster, plain: object
) -> None:
    system, tail_a, tail_b = prompts_of_lengths([64, 40, 50], seed=13)
    cluster.ask(0, "seed-prefix", [*system, 7])  # caches the 4 pages of `system`
    long_a, long_b = system + tail_a, system + tail_b
    decoder = cluster.decoders[0]
    stream_a = decoder.submit(
        "sharer-a",
        long_a,
        SamplingParams(temperature=0.0, max_tokens=200),
        cluster.prefill.endpoint,
    )
    stream_b = decoder.submit("sharer-b", long_b, GREEDY, cluster.prefill.endpoint)
    wait_until(
        lambda: (
            decoder.transfer_stats("sharer-a") is not None
            or decoder.transfer_progress("sharer-a") is not None
        ),
        what="sharer-a asked for its KV",
    )
    assert decoder.abort("sharer-a")
    tokens_b, final_b = stream_b.result(60)
    assert final_b.error is None
    assert tokens_b == reference(plain, long_b)
    _, final_a = stream_a.result(60)
    assert final_a.finish_reason == "abort"
    assert check_transfer(cluster, 0, "sharer-b", long_b) == len(system) // PAGE
    cluster.assert_pools_full()
