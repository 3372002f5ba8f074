"""Regressions of the prefill-side review of the KV messenger and its wire protocol.

1. A request id reused right after an abort: the engine's final ``abort`` output of the old
   request is never taken for the new one's (real workers over ``tcp``, the tiny preset); the
   new request is served with the right KV and both pools are full again.
2. A ``detail`` string is bounded in UTF-8 bytes, as the receiver's msgpack limit counts: every
   message the encoder accepts, the decoder accepts; the prefill side cuts the details it builds
   at a character boundary, so a multi-byte detail reaches the decoder (not dropped as
   malformed, leaving the request to its deadline).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine.engine_helpers import make_engine, prompts_of_lengths, run_engine
from tests.kv.harness import decode_pool_full, wait_until
from workers.engine.config import EngineConfig
from workers.engine.errors import CapacityError
from workers.engine.sampling_params import SamplingParams
from workers.kv.decode_messenger import DecodeMessengerConfig
from workers.kv.errors import ProtocolError
from workers.kv.protocol import (
    MAX_DETAIL_BYTES,
    MAX_ID_CHARS,
    FailReason,
    PrefillFailed,
    PrefillRejected,
    RejectReason,
    decode_message,
    encode_message,
    truncate_detail,
)
from workers.kv.worker import DecodeWorker, PrefillWorker

PROVIDER = "tcp;ofi_rxm"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
DECODE_PAGES = 200
PREFILL_PAGES = 128
EURO = "\u20ac"  # 3 UTF-8 bytes


# -- 2. detail bounded in UTF-8 bytes -----------------------------------------------------------


@pytest.mark.parametrize("make", ["failed", "rejected"])
def test_a_multi_byte_detail_at_the_byte_limit_round_trips(make: str) -> None:
    detail = "x" + EURO * ((MAX_DETAIL_BYTES - 1) // 3)  # 342 chars, exactly the byte limit
    assert len(detail.encode()) == MAX_DETAIL_BYTES
    message = (
        PrefillFailed("r\u00e9", 7, FailReason.WRITE_ERROR, 12, detail)
        if make == "failed"
        else PrefillRejected("r\u00e9", 7, RejectReason.INTERNAL, detail)
    )
    assert decode_message(encode_message(message)) == message


@pytest.mark.parametrize("make", ["failed", "rejected"])
def test_a_detail_over_the_byte_limit_is_refused_at_encode_time(make: str) -> None:
    detail = "\ufffd" * 400  # 400 chars (well under 1024) but 1200 bytes
    with pytest.raises(ProtocolError, match="UTF-8 bytes"):
        if make == "failed":
            PrefillFailed("r1", 7, FailReason.WRITE_ERROR, 12, detail)
        else:
            PrefillRejected("r1", 7, RejectReason.INTERNAL, detail)


def test_a_detail_that_utf8_cannot_carry_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="UTF-8"):
        PrefillFailed("r1", 7, FailReason.INTERNAL, 0, "lone \udc80 surrogate")


def test_the_longest_request_id_fits_the_wire() -> None:
    longest = "\U0001f600" * MAX_ID_CHARS  # 4 bytes each: the most bytes an id can have
    message = PrefillFailed(longest, 1, FailReason.DEADLINE, 0)
    assert decode_message(encode_message(message)) == message


def test_truncate_detail_cuts_at_a_character_boundary() -> None:
    for prefix in ("", "x", "xy"):  # the cut falls after, inside, inside a 3-byte character
        cut = truncate_detail(prefix + EURO * 1000)
        assert len(cut.encode()) <= MAX_DETAIL_BYTES
        assert len(cut.encode()) > MAX_DETAIL_BYTES - 3
        assert cut == prefix + EURO * (len(cut) - len(prefix))
        message = PrefillFailed("r1", 1, FailReason.ENGINE_ERROR, 0, cut)
        assert decode_message(encode_message(message)) == message
    assert truncate_detail("short") == "short"
    assert truncate_detail("a \udc80 b") == "a ? b"


# -- real workers -------------------------------------------------------------------------------


def reference(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return run_engine(make_engine(model_dir), prompts, GREEDY)


def assert_pools_full(prefill: PrefillWorker, decode: DecodeWorker) -> None:
    wait_until(lambda: decode_pool_full(decode, DECODE_PAGES), what="decode pool full again")

    def prefill_full() -> bool:
        state = prefill.state()  # on the step loop: raises if it died
        return state["num_free_pages"] == PREFILL_PAGES and state["num_transfers"] == 0

    wait_until(prefill_full, what="prefill pool full again")


@pytest.fixture
def pair(tiny_model_dir: Path) -> Iterator[tuple[PrefillWorker, DecodeWorker]]:
    # 16 tokens a step: a long prompt keeps the prefill engine busy for many steps.
    prefill = PrefillWorker(
        tiny_model_dir,
        EngineConfig(num_pages=PREFILL_PAGES, max_num_batched_tokens=16),
        provider=PROVIDER,
    )
    decode = DecodeWorker(
        tiny_model_dir,
        EngineConfig(num_pages=DECODE_PAGES),
        provider=PROVIDER,
        messenger_config=DecodeMessengerConfig(transfer_timeout_s=30.0, drain_interval_s=0.2),
    )
    yield prefill, decode
    decode.close()
    prefill.close(drain_timeout_s=2.0)


@pytest.mark.slow
def test_a_multi_byte_engine_refusal_reaches_the_decoder_at_once(
    pair: tuple[PrefillWorker, DecodeWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    prefill, decode = pair
    real_add_request = prefill.engine.add_request
    refused: list[str] = []

    def refuse_once(request_id: str, *args: Any, **kwargs: Any) -> None:
        if not refused:
            refused.append(request_id)
            raise CapacityError("\ufffd" * 1000)  # 1000 chars, 3000 UTF-8 bytes
        real_add_request(request_id, *args, **kwargs)

    # NAMED FAULT INJECTION: the engine refuses a request at admission with a long non-ASCII
    # message (`check_request` mirrors the engine's bounds, so no real request reaches this).
    monkeypatch.setattr(prefill.engine, "add_request", refuse_once)
    (prompt,) = prompts_of_lengths([40], seed=4)
    # Far below the 30 s transfer deadline: the rejection itself arrived, not the deadline.
    tokens, final = decode.submit("refused", prompt, GREEDY, prefill.endpoint()).result(10)
    assert refused == ["refused"]
    assert tokens == [] and final.error is not None and "TOO_LONG" in final.error, final
    assert "\ufffd" in final.error
    assert_pools_full(prefill, decode)


# -- 1. a request id reused right after an abort ------------------------------------------------


@pytest.mark.slow
def test_a_reused_request_id_is_not_given_the_old_ones_abort(
    tiny_model_dir: Path, pair: tuple[PrefillWorker, DecodeWorker]
) -> None:
    prefill, decode = pair
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
    assert_pools_full(prefill, decode)
    assert not prefill._loop.call(prefill.engine.has_unfinished)
