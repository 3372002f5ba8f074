"""A decode worker prefills a request itself when the router gives it no prefill worker (its
local-prefill fallback, `router.local_prefill_fallback`): the outputs are the colocated
engine's, token for token, and its pool is full again afterwards. Real worker, real engine on
the tiny preset, through the served backend (an empty prefill endpoint)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.engine_helpers import make_engine, prompts_of_lengths, run_engine
from tests.kv.harness import decode_pool_full
from tests.waiting import wait_until
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams
from workers.service.backend import Sink
from workers.service.kv_backends import DecodeBackend
from workers.wire import TokenDelta

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
DECODE_PAGES = 200

pytestmark = pytest.mark.slow


def test_a_request_without_a_prefill_worker_is_prefilled_by_the_decoder(
    tiny_model_dir: Path,
) -> None:
    prompts = prompts_of_lengths([1, 40, 300], seed=3)
    expected = run_engine(make_engine(tiny_model_dir), prompts, GREEDY)
    backend = DecodeBackend(
        tiny_model_dir, EngineConfig(num_pages=DECODE_PAGES), "tcp;ofi_rxm", "127.0.0.1", {}
    )
    try:
        tokens: dict[str, list[int]] = {}
        reasons: dict[str, str | None] = {}

        def sink_for(request_id: str) -> Sink:
            def sink(delta: TokenDelta) -> None:  # the worker's step thread
                tokens.setdefault(request_id, []).extend(delta.token_ids)
                if delta.finished:
                    reasons[request_id] = delta.error or delta.finish_reason

            return sink

        ids = [f"local-{i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts, strict=True):
            backend.submit(request_id, prompt, GREEDY, b"", sink_for(request_id))
        wait_until(lambda: len(reasons) == len(ids), what="every request finished")
        assert [reasons[i] for i in ids] == ["length"] * len(ids)
        assert [tokens[i] for i in ids] == expected
        # Nothing went over the fabric; every page is free again.
        assert backend.worker.imm_writes_received() == 0
        assert backend.worker.transfer_stats("local-1") is None
        wait_until(lambda: decode_pool_full(backend.worker, DECODE_PAGES), what="pool full")
    finally:
        backend.close()
