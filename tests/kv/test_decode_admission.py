"""A decoder pins a new prompt's pages only while the pages every live request still needs to
finish stay free (`DecodeMessenger._reserve`).

Without that reserve a decoder whose pool fills with pinned prompts preempts a running answer
when it needs its next page, and then computes that answer's prompt again itself: on a loaded
cluster the one decoder prefilled prompts at decode priority, beside the prefill workers, and
throughput fell as load rose. Here four prompts whose answers do not fit the decoder's pool
together arrive at once: each must be admitted in turn, none preempted, none recomputed, with
greedy outputs equal to the colocated engine's and both pools full again afterwards.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.engine_helpers import make_engine, prompts_of_lengths, run_engine
from tests.kv.harness import RemotePrefill
from tests.waiting import wait_until
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams
from workers.service.kv_worker import DecodeWorker

DECODE_PAGES = 40  # 640 tokens: two of the requests below to the end, not three
PREFILL_PAGES = 96
LENGTHS = [150, 151, 152, 153]  # 10 pages of prompt KV each
GREEDY = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)  # 4 pages more each

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("provider", ["tcp;ofi_rxm"])
def test_a_decoder_never_recomputes_a_prompt_it_was_sent(
    tiny_model_dir: Path, provider: str
) -> None:
    prompts = prompts_of_lengths(LENGTHS, seed=11)
    expected = run_engine(make_engine(tiny_model_dir), prompts, GREEDY)
    prefill = RemotePrefill(tiny_model_dir, provider, engine={"num_pages": PREFILL_PAGES})
    decode = DecodeWorker(tiny_model_dir, EngineConfig(num_pages=DECODE_PAGES), provider=provider)
    try:
        engine = decode.engine
        # Two requests fit the pool to their ends, three do not; all four prompts pinned at
        # once would fill it, leaving no page for the first answer's growth.
        final_pages = engine.final_pages(LENGTHS[-1], GREEDY.max_tokens)
        assert 2 * final_pages <= DECODE_PAGES < 3 * final_pages
        assert len(LENGTHS) * engine.num_prefill_pages(LENGTHS[0]) >= DECODE_PAGES
        streams = [
            decode.submit(f"r{i}", prompt, GREEDY, prefill.endpoint)
            for i, prompt in enumerate(prompts)
        ]
        results = [stream.result(120) for stream in streams]
        assert [final.error for _, final in results] == [None] * len(prompts)
        assert [tokens for tokens, _ in results] == expected
        assert engine.stats.num_preemptions == 0
        # The decoder computed each prompt's last token only (the rest came over the fabric).
        assert engine.stats.num_computed_prompt_tokens == len(prompts)
        wait_until(lambda: decode.state()["num_free_pages"] == DECODE_PAGES, what="decode pool")
        wait_until(lambda: prefill.state()["num_free_pages"] == PREFILL_PAGES, what="prefill pool")
        assert decode.state()["num_transfers"] == 0
    finally:
        decode.close()
        assert prefill.close() == 0
