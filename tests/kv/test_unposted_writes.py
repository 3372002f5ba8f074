"""Writes the fabric refuses at once were never posted: the prefill side takes them back out of
the count it reports (`workers.kv.submit_gate`), so the decoder's quarantine is released when
what was posted landed, instead of waiting forever for writes that never come.

Real workers over ``tcp`` (real engines on the tiny preset, real libfabric); the refusal is a
NAMED FAULT INJECTION (a full submission queue cannot be produced on demand).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine.engine_helpers import make_engine, prompts_of_lengths, run_engine
from tests.kv.harness import decode_pool_full, wait_pools_full
from tests.waiting import wait_until
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams
from workers.fabric import SubmitQueueFullError
from workers.kv.decode_messenger import DecodeMessengerConfig
from workers.service.kv_worker import DecodeWorker, PrefillWorker

PROVIDER = "tcp;ofi_rxm"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
DECODE_PAGES = 200
PREFILL_PAGES = 64

pytestmark = pytest.mark.slow


@pytest.fixture
def pair(tiny_model_dir: Path) -> Iterator[tuple[PrefillWorker, DecodeWorker]]:
    prefill = PrefillWorker(
        tiny_model_dir, EngineConfig(num_pages=PREFILL_PAGES), provider=PROVIDER
    )
    decode = DecodeWorker(
        tiny_model_dir,
        EngineConfig(num_pages=DECODE_PAGES),
        provider=PROVIDER,
        messenger_config=DecodeMessengerConfig(transfer_timeout_s=5.0, drain_interval_s=0.2),
    )
    yield prefill, decode
    decode.close()
    prefill.close(drain_timeout_s=2.0)


@pytest.mark.parametrize("refused_call", ["submit_prepared", "submit_write"])
def test_writes_never_posted_are_not_reported_and_the_quarantine_drains(
    tiny_model_dir: Path,
    pair: tuple[PrefillWorker, DecodeWorker],
    monkeypatch: pytest.MonkeyPatch,
    refused_call: str,
) -> None:
    """``submit_prepared``: a layer's KV writes; ``submit_write``: the context write."""
    prefill, decode = pair
    warm, bad, after = prompts_of_lengths([100, 100, 90], seed=5)
    endpoint = prefill.endpoint()
    expected_warm, expected_after = run_engine(make_engine(tiny_model_dir), [warm, after], GREEDY)
    assert decode.submit("warm", warm, GREEDY, endpoint).result(30)[0] == expected_warm

    real: Callable[..., Any] = getattr(prefill.fabric, refused_call)
    refused: list[int] = []

    def refuse_once(*args: Any, **kwargs: Any) -> Any:
        if not refused:
            refused.append(1)
            raise SubmitQueueFullError("injected: submission queue full")
        return real(*args, **kwargs)

    # NAMED FAULT INJECTION: the fabric refuses one submission at once (its submit queue full).
    # Whether the queue is full at that instant depends on the fabric progress thread's
    # scheduling, which a test cannot arrange for real; the error is the fabric's own.
    monkeypatch.setattr(prefill.fabric, refused_call, refuse_once)
    tokens, final = decode.submit("bad", bad, GREEDY, endpoint).result(30)
    assert refused == [1]
    assert tokens == [] and final.error is not None, final
    assert "WRITE_ERROR" in final.error, final.error

    # Every write that was posted lands; the prefill's count names exactly those, so the
    # quarantine drains (a count that included writes that never come would hold it forever).
    wait_until(lambda: decode_pool_full(decode, DECODE_PAGES), what="decode pool full again")
    record = decode.transfer_stats("bad") or {}
    assert record.get("quarantine_release") == "drained", record
    sent = prefill.transfer_stats("bad") or {}
    assert sent["state"] == "failed", sent
    assert sent["num_writes"] < sent["num_writes_planned"], sent
    assert record["num_writes_landed"] == sent["num_writes"], (record, sent)
    assert "not posted" in final.error, final.error
    assert decode.submit("after", after, GREEDY, endpoint).result(30)[0] == expected_after
    wait_pools_full(prefill, decode, prefill_pages=PREFILL_PAGES, decode_pages=DECODE_PAGES)
