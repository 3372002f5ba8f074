"""KV control messages authenticated with the cluster's secret (`workers.kv.protocol`), with real
workers over ``tcp`` on the tiny preset.

- Workers sharing the secret serve requests (outputs equal the colocated engine's): every
  message both ways carried a MAC the other side checked; both pools are full again.
- A decoder without the secret, or with another one, stands in for a process outside the
  cluster that reaches the prefill worker's endpoint: its prefill requests are refused before
  they are parsed (no reply, nothing allocated, no write) and counted in
  ``num_unauthenticated_messages``; the decoder's request ends at its deadline.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.engine_helpers import make_engine, prompts_of_lengths, run_engine
from tests.kv.harness import wait_pools_full
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams
from workers.kv.decode_messenger import DecodeMessengerConfig
from workers.kv.prefill_messenger import PrefillMessengerConfig
from workers.service.kv_worker import DecodeWorker, PrefillWorker

PROVIDER = "tcp;ofi_rxm"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
DECODE_PAGES = 64
PREFILL_PAGES = 64
SECRET = secrets.token_bytes(32)

pytestmark = pytest.mark.slow


@pytest.fixture
def prefill(tiny_model_dir: Path) -> Iterator[PrefillWorker]:
    worker = PrefillWorker(
        tiny_model_dir,
        EngineConfig(num_pages=PREFILL_PAGES),
        provider=PROVIDER,
        messenger_config=PrefillMessengerConfig(secret=SECRET),
    )
    yield worker
    worker.close(drain_timeout_s=2.0)


def decode_worker(model_dir: Path, secret: bytes | None) -> DecodeWorker:
    return DecodeWorker(
        model_dir,
        EngineConfig(num_pages=DECODE_PAGES),
        provider=PROVIDER,
        messenger_config=DecodeMessengerConfig(transfer_timeout_s=3.0, secret=secret),
    )


def test_workers_sharing_the_secret_serve(prefill: PrefillWorker, tiny_model_dir: Path) -> None:
    prompts = prompts_of_lengths([5, 40])
    expected = run_engine(make_engine(tiny_model_dir), prompts, GREEDY)
    decode = decode_worker(tiny_model_dir, SECRET)
    try:
        streams = [
            decode.submit(f"r{i}", prompt, GREEDY, prefill.endpoint())
            for i, prompt in enumerate(prompts)
        ]
        results = [stream.result(30) for stream in streams]
        assert [final.error for _, final in results] == [None, None]
        assert [tokens for tokens, _ in results] == expected
        wait_pools_full(prefill, decode, prefill_pages=PREFILL_PAGES, decode_pages=DECODE_PAGES)
        assert prefill.state()["num_unauthenticated_messages"] == 0
        assert decode.state()["num_unauthenticated_messages"] == 0
    finally:
        decode.close()


@pytest.mark.parametrize("secret", [None, secrets.token_bytes(32)], ids=["none", "another"])
def test_a_request_without_the_secret_is_refused_and_counted(
    prefill: PrefillWorker, tiny_model_dir: Path, secret: bytes | None
) -> None:
    (prompt,) = prompts_of_lengths([40])
    decode = decode_worker(tiny_model_dir, secret)
    try:
        tokens, final = decode.submit("forged", prompt, GREEDY, prefill.endpoint()).result(30)
        assert tokens == [] and final.error is not None
        assert "deadline" in final.error or "timed out" in final.error, final.error
        # The request, then the aborts the decoder re-sends for it: all refused.
        assert prefill.state()["num_unauthenticated_messages"] >= 1
        assert prefill.transfer_stats("forged") is None  # never admitted
        assert prefill.engine.stats.num_computed_prompt_tokens == 0
        assert prefill.state()["num_free_pages"] == PREFILL_PAGES
        # The decoder cannot tell that nothing will be written: its pages stay quarantined
        # until the prefill worker acknowledges an abort, as after any unanswered transfer.
        assert decode.state()["num_quarantined_pages"] > 0
    finally:
        decode.close()
