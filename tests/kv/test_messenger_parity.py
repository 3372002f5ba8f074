"""Disaggregated serving end to end: a prefill worker process pushes KV into a decode worker.

Greedy output must be token-identical to the colocated engine and to HF transformers; the
decoder must receive exactly the documented number of writes; the hidden state of the last
prefilled position must arrive in the context buffer; both KV pools must be full again.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.engine.engine_helpers import hf_greedy, make_engine, prompts_of_lengths, run_engine
from tests.kv.harness import RemotePrefill
from tests.waiting import wait_until
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams
from workers.kv.sharding import GroupSharding, PageGeometry, make_transfer_plan
from workers.kv.writes import expected_write_count
from workers.service.kv_worker import DecodeWorker

PROVIDERS = ["tcp;ofi_rxm", "shm"]
PAGE = 16
BUDGET = 64  # chunked prefill on: 4-page chunks, so the 500-token prompt takes 8 passes
LENGTHS = [1, 2, PAGE, PAGE + 1, 500]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
TINY = {"layers": 4, "kv_heads": 2, "head_dim": 32, "hidden": 256}

pytestmark = pytest.mark.slow


class Pair:
    def __init__(self, model_dir: Path, provider: str) -> None:
        self.prefill = RemotePrefill(
            model_dir,
            provider,
            engine={"num_pages": 96, "max_num_batched_tokens": BUDGET},
        )
        self.decode = DecodeWorker(model_dir, EngineConfig(num_pages=120), provider=provider)

    def close(self) -> None:
        self.decode.close()
        assert self.prefill.close() == 0


@pytest.fixture(scope="module", params=PROVIDERS)
def pair(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[Pair]:
    pair = Pair(tiny_model_dir, str(request.param))
    yield pair
    pair.close()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompts_of_lengths(LENGTHS, seed=4)


@pytest.fixture(scope="module")
def colocated(tiny_model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return run_engine(make_engine(tiny_model_dir), prompts, GREEDY)


def formula_count(src_pages: list[int], dst_pages: list[int], segment_pages: int) -> int:
    """README's formula for TP 1:1: layers x runs (cut at segments) + 1 context write."""
    sharding = GroupSharding(1, TINY["kv_heads"])
    geometry = PageGeometry(TINY["layers"], PAGE, TINY["head_dim"], 4)
    plan = make_transfer_plan(
        sharding, sharding, geometry, source_sets=(0,), segment_pages=segment_pages or None
    )
    return expected_write_count(plan, src_pages, dst_pages, TINY["layers"], 1)


def assert_pools_full(pair: Pair) -> None:
    wait_until(lambda: pair.decode.state()["num_free_pages"] == 120, what="decode pool full")
    wait_until(lambda: pair.prefill.state()["num_free_pages"] == 96, what="prefill pool full")
    assert pair.decode.state()["num_transfers"] == 0
    assert pair.prefill.state()["num_transfers"] == 0


def test_concurrent_greedy_parity_and_write_count(
    pair: Pair, tiny_model_dir: Path, prompts: list[list[int]], colocated: list[list[int]]
) -> None:
    received_before = pair.decode.imm_writes_received()
    endpoint = pair.prefill.endpoint
    assert endpoint.segment_pages == BUDGET // PAGE
    streams = [
        pair.decode.submit(f"c{i}", prompt, GREEDY, endpoint) for i, prompt in enumerate(prompts)
    ]
    results = [stream.result(60) for stream in streams]
    tokens = [result[0] for result in results]
    assert [final.error for _, final in results] == [None] * len(prompts)
    assert tokens == colocated
    for prompt, got in zip(prompts, tokens, strict=True):
        assert got == hf_greedy(tiny_model_dir, prompt, GREEDY.max_tokens)

    total = 0
    for i, prompt in enumerate(prompts):
        decode_stats = pair.decode.transfer_stats(f"c{i}")
        if len(prompt) == 1:
            assert decode_stats is None  # a one-token prompt needs no prefill
            continue
        prefill_stats = pair.prefill.stats(f"c{i}")
        assert decode_stats is not None and prefill_stats["state"] == "done"
        expected = formula_count(
            prefill_stats["src_pages"], decode_stats["page_ids"], endpoint.segment_pages
        )
        assert decode_stats["num_writes_expected"] == expected
        assert prefill_stats["num_writes"] == prefill_stats["num_writes_planned"] == expected
        total += expected
    # Observed at the decoder's NIC: every write that landed, no more, no fewer.
    wait_until(lambda: pair.decode.imm_writes_received() - received_before >= total)
    assert pair.decode.imm_writes_received() - received_before == total
    assert_pools_full(pair)


def test_context_write_is_the_last_prefilled_hidden_state(
    pair: Pair, tiny_model_dir: Path, prompts: list[list[int]], colocated: list[list[int]]
) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for index in (3, 4):  # 17 and 500 tokens: one and several chunks
        prompt = prompts[index]
        tokens, final = pair.decode.submit(
            f"h{index}", prompt, GREEDY, pair.prefill.endpoint
        ).result(60)
        assert tokens == colocated[index], final.error
        with torch.no_grad():
            hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1]
        context = pair.decode.context_state(f"h{index}")
        torch.testing.assert_close(context, hidden[0, len(prompt) - 2], atol=2e-4, rtol=1e-4)
    assert_pools_full(pair)


def test_sequential_requests_reuse_pages(
    pair: Pair, prompts: list[list[int]], colocated: list[list[int]]
) -> None:
    for round_ in range(2):
        for i in (1, 3, 4):
            stream = pair.decode.submit(f"s{round_}-{i}", prompts[i], GREEDY, pair.prefill.endpoint)
            tokens, final = stream.result(60)
            assert tokens == colocated[i], final.error
    assert_pools_full(pair)
