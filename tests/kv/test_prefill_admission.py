"""Admission to the prefill engine, with real workers over ``tcp`` (real engines on the tiny
preset, real libfabric), both pools full again at the end of each test.

- A prompt that can never fit the prefill pool is rejected TOO_LONG up front (the bound the
  engine applies at admission), before anything is allocated for it.
- An engine refusal at admission rejects the request, never kills the prefill step loop, and
  reaches the decoder at once with its (multi-byte) detail.
- A request id reused right after an abort: the engine's final ``abort`` output of the old
  request is never taken for the new one's; the new one is served with the right KV.

The engine refusal is a NAMED FAULT INJECTION (`check_request` mirrors the engine's bounds, so
no real request reaches it).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine.engine_helpers import make_engine, prompts_of_lengths, run_engine
from tests.kv.harness import wait_pools_full
from tests.waiting import wait_until
from workers.engine.config import EngineConfig
from workers.engine.errors import CapacityError
from workers.engine.sampling_params import SamplingParams
from workers.kv.decode_messenger import DecodeMessengerConfig
from workers.service.kv_worker import DecodeWorker, PrefillWorker

PROVIDER = "tcp;ofi_rxm"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
PAGE_SIZE = 16
DECODE_PAGES = 200
PREFILL_PAGES = 64
BUSY_PREFILL_PAGES = 128

pytestmark = pytest.mark.slow


def decode_worker(model_dir: Path, *, timeout_s: float) -> DecodeWorker:
    return DecodeWorker(
        model_dir,
        EngineConfig(num_pages=DECODE_PAGES),
        provider=PROVIDER,
        messenger_config=DecodeMessengerConfig(transfer_timeout_s=timeout_s, drain_interval_s=0.2),
    )


def reference(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return run_engine(make_engine(model_dir), prompts, GREEDY)


@pytest.fixture
def pair(tiny_model_dir: Path) -> Iterator[tuple[PrefillWorker, DecodeWorker]]:
    prefill = PrefillWorker(
        tiny_model_dir, EngineConfig(num_pages=PREFILL_PAGES), provider=PROVIDER
    )
    decode = decode_worker(tiny_model_dir, timeout_s=5.0)
    yield prefill, decode
    decode.close()
    prefill.close(drain_timeout_s=2.0)


@pytest.fixture
def busy_pair(tiny_model_dir: Path) -> Iterator[tuple[PrefillWorker, DecodeWorker]]:
    """16 tokens a step: a long prompt keeps the prefill engine busy for many steps."""
    prefill = PrefillWorker(
        tiny_model_dir,
        EngineConfig(num_pages=BUSY_PREFILL_PAGES, max_num_batched_tokens=16),
        provider=PROVIDER,
    )
    decode = decode_worker(tiny_model_dir, timeout_s=30.0)
    yield prefill, decode
    decode.close()
    prefill.close(drain_timeout_s=2.0)


def refuse_first_admission(
    prefill: PrefillWorker, monkeypatch: pytest.MonkeyPatch, message: str
) -> list[str]:
    """NAMED FAULT INJECTION: the prefill engine refuses the first request at admission with
    ``message`` (a `CapacityError`: an EngineError, not an InvalidRequestError). It stands in
    for any engine validation the checks might not mirror. Returns the refused request ids."""
    real_add_request = prefill.engine.add_request
    refused: list[str] = []

    def refuse_once(request_id: str, *args: Any, **kwargs: Any) -> None:
        if not refused:
            refused.append(request_id)
            raise CapacityError(message.format(request_id=request_id))
        real_add_request(request_id, *args, **kwargs)

    monkeypatch.setattr(prefill.engine, "add_request", refuse_once)
    return refused


def test_a_prompt_filling_the_prefill_pool_is_rejected_and_the_loop_lives(
    tiny_model_dir: Path,
) -> None:
    num_pages = 8  # 128 tokens
    prefill = PrefillWorker(tiny_model_dir, EngineConfig(num_pages=num_pages), provider=PROVIDER)
    decode = decode_worker(tiny_model_dir, timeout_s=5.0)
    try:
        # 128 prompt tokens: 127 prefilled (8 pages, the whole pool) but the engine is given 128
        # (a stand-in last token) and wants room for one more: it can never be admitted.
        too_long, fits = prompts_of_lengths([num_pages * PAGE_SIZE, num_pages * PAGE_SIZE - 1])
        tokens, final = decode.submit("edge", too_long, GREEDY, prefill.endpoint()).result(30)
        assert tokens == [] and final.finish_reason == "error"
        assert final.error is not None and "TOO_LONG" in final.error, final.error
        # Refused by the checks, before anything (a transfer, a context row) was allocated.
        assert prefill.transfer_stats("edge") is None
        # The largest prompt the engine takes is served, by the same (living) step loop.
        (expected,) = reference(tiny_model_dir, [fits])
        assert decode.submit("fits", fits, GREEDY, prefill.endpoint()).result(30)[0] == expected
        wait_pools_full(prefill, decode, prefill_pages=num_pages, decode_pages=DECODE_PAGES)
    finally:
        decode.close()
        prefill.close(drain_timeout_s=2.0)


def test_an_engine_refusal_at_admission_rejects_the_request_not_the_loop(
    tiny_model_dir: Path, pair: tuple[PrefillWorker, DecodeWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    prefill, decode = pair
    refused = refuse_first_admission(prefill, monkeypatch, "request {request_id}: injected refusal")
    short, again = prompts_of_lengths([40, 41], seed=3)
    tokens, final = decode.submit("refused", short, GREEDY, prefill.endpoint()).result(30)
    assert refused == ["refused"]
    assert tokens == [] and final.error is not None and "TOO_LONG" in final.error, final
    (expected,) = reference(tiny_model_dir, [again])
    assert decode.submit("again", again, GREEDY, prefill.endpoint()).result(30)[0] == expected
    wait_pools_full(prefill, decode, prefill_pages=PREFILL_PAGES, decode_pages=DECODE_PAGES)


def test_a_multi_byte_engine_refusal_reaches_the_decoder_at_once(
    busy_pair: tuple[PrefillWorker, DecodeWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefill side cuts the details it builds at a character boundary within the wire's
    byte limit, so a long non-ASCII refusal reaches the decoder (not dropped as malformed,
    leaving the request to its deadline)."""
    prefill, decode = busy_pair
    refused = refuse_first_admission(prefill, monkeypatch, "\ufffd" * 1000)  # 3000 UTF-8 bytes
    (prompt,) = prompts_of_lengths([40], seed=4)
    # Far below the 30 s transfer deadline: the rejection itself arrived, not the deadline.
    tokens, final = decode.submit("refused", prompt, GREEDY, prefill.endpoint()).result(10)
    assert refused == ["refused"]
    assert tokens == [] and final.error is not None and "TOO_LONG" in final.error, final
    assert "\ufffd" in final.error
    wait_pools_full(prefill, decode, prefill_pages=BUSY_PREFILL_PAGES, decode_pages=DECODE_PAGES)


def test_a_reused_request_id_is_not_given_the_old_ones_abort(
    tiny_model_dir: Path, busy_pair: tuple[PrefillWorker, DecodeWorker]
) -> None:
    prefill, decode = busy_pair
    big, first, second = prompts_of_lengths([1600, 40, 40], seed=3)
    expected_big, expected_second = reference(tiny_model_dir, [big, second])
    endpoint = prefill.endpoint()
    big_stream = decode.submit("big", big, GREEDY, endpoint)
    wait_until(lambda: (decode.transfer_progress("big") or (0, 0))[0] > 0, what="big running")
    first_stream = decode.submit("r1", first, GREEDY, endpoint)

    def r1_waits_in_the_engine() -> bool:
        # Admitted to the engine (none queued in the messenger), no chunk scheduled yet.
        state = prefill.state()
        return state["num_queued"] == 0 and state["transfers_by_state"].get("queued") == 1

    wait_until(r1_waits_in_the_engine, what="r1 admitted behind big")

    # The abort and the new request must reach the prefill messenger in one poll: its step
    # thread is held (a call on its loop) until both messages are in its inbox.
    held, release = threading.Event(), threading.Event()
    state_when_held: dict[str, Any] = {}

    def hold() -> None:
        state_when_held.update(prefill.messenger.state())
        held.set()
        release.wait(30)

    holder = threading.Thread(target=prefill._loop.call, args=(hold,))
    holder.start()
    try:
        assert held.wait(30)
        assert state_when_held["transfers_by_state"] == {"prefilling": 1, "queued": 1}
        assert decode.abort("r1")
        second_stream = decode.submit("r1", second, GREEDY, endpoint)
        inbox = prefill.messenger._inbox
        wait_until(lambda: inbox.qsize() >= 2, what="abort and new r1 in the prefill inbox")
    finally:
        release.set()
        holder.join(30)

    assert first_stream.result(30)[1].finish_reason == "abort"
    tokens, final = second_stream.result(60)
    assert final.error is None, final
    assert tokens == expected_second  # the KV it decoded from is the new prompt's
    assert big_stream.result(120)[0] == expected_big
    stats = prefill.transfer_stats("r1")
    assert stats is not None and stats["state"] == "done", stats
    # Both pools full: the new r1 is not held in the prefill engine, nothing undercounted.
    wait_pools_full(prefill, decode, prefill_pages=BUSY_PREFILL_PAGES, decode_pages=DECODE_PAGES)
    assert not prefill._loop.call(prefill.engine.has_unfinished)
