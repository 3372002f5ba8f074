"""Regressions of the KV messenger review: each scenario with real workers over ``tcp`` (real
engines on the tiny preset, real libfabric, a real prefill process where it must be stopped),
both pools full again at the end.

1. A prompt exactly filling the prefill pool is rejected TOO_LONG up front (the bound the engine
   applies at admission); an engine refusal at admission rejects the request, never kills the
   prefill step loop.
2. Writes the fabric refuses at once were never posted: they are taken back out of the count
   the prefill reports, so the decoder's quarantine is released when what was posted landed.
3. A decoder the prefill fabric marked failed (an operation missed its deadline) is resolved
   afresh when it sends again: it is alive.
4. An endpoint naming another incarnation (unversioned, or one the live worker rejects as
   stale) frees no quarantined page of a live (stopped) prefill worker.

Fault injections are used only where the fault cannot be produced for real, and each is named
as such where it is installed.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine.engine_helpers import make_engine, prompts_of_lengths, run_engine
from tests.kv.harness import RemotePrefill, decode_pool_full, wait_until
from workers.engine.config import EngineConfig
from workers.engine.errors import CapacityError
from workers.engine.sampling_params import SamplingParams
from workers.fabric import OperationTimeoutError, SubmitQueueFullError
from workers.kv.decode_messenger import DecodeMessengerConfig
from workers.kv.worker import DecodeWorker, PrefillWorker

PROVIDER = "tcp;ofi_rxm"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
PAGE_SIZE = 16
DECODE_PAGES = 200
PREFILL_PAGES = 64

pytestmark = pytest.mark.slow


def decode_worker(model_dir: Path, *, timeout_s: float, drain_s: float = 0.2) -> DecodeWorker:
    return DecodeWorker(
        model_dir,
        EngineConfig(num_pages=DECODE_PAGES),
        provider=PROVIDER,
        messenger_config=DecodeMessengerConfig(
            transfer_timeout_s=timeout_s, drain_interval_s=drain_s
        ),
    )


def prefill_pool_full(state: dict[str, Any], num_pages: int) -> bool:
    return state["num_free_pages"] == num_pages and state["num_transfers"] == 0


def assert_pools_full(prefill: PrefillWorker, decode: DecodeWorker, prefill_pages: int) -> None:
    wait_until(lambda: decode_pool_full(decode, DECODE_PAGES), what="decode pool full again")
    # state() runs on the prefill step loop: it raises if the loop died.
    wait_until(
        lambda: prefill_pool_full(prefill.state(), prefill_pages), what="prefill pool full again"
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


# -- 1. capacity edge ---------------------------------------------------------------------------


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
        assert_pools_full(prefill, decode, num_pages)
    finally:
        decode.close()
        prefill.close(drain_timeout_s=2.0)


def test_an_engine_refusal_at_admission_rejects_the_request_not_the_loop(
    tiny_model_dir: Path, pair: tuple[PrefillWorker, DecodeWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    prefill, decode = pair
    real_add_request = prefill.engine.add_request
    refused: list[str] = []

    def refuse_once(request_id: str, *args: Any, **kwargs: Any) -> None:
        if not refused:
            refused.append(request_id)
            raise CapacityError(f"request {request_id}: injected refusal")
        real_add_request(request_id, *args, **kwargs)

    # NAMED FAULT INJECTION: the engine refuses a request at admission. `check_request` now
    # applies every bound the engine does, so no real request reaches this; it stands in for
    # any engine validation the checks might not mirror (CapacityError is an EngineError, not
    # an InvalidRequestError).
    monkeypatch.setattr(prefill.engine, "add_request", refuse_once)
    short, again = prompts_of_lengths([40, 41], seed=3)
    tokens, final = decode.submit("refused", short, GREEDY, prefill.endpoint()).result(30)
    assert refused == ["refused"]
    assert tokens == [] and final.error is not None and "TOO_LONG" in final.error, final
    (expected,) = reference(tiny_model_dir, [again])
    assert decode.submit("again", again, GREEDY, prefill.endpoint()).result(30)[0] == expected
    assert_pools_full(prefill, decode, PREFILL_PAGES)


# -- 2. writes never posted ---------------------------------------------------------------------


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
    expected_warm, expected_after = reference(tiny_model_dir, [warm, after])
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
    # quarantine drains (the count of before included writes that never come: held forever).
    wait_until(lambda: decode_pool_full(decode, DECODE_PAGES), what="decode pool full again")
    record = decode.transfer_stats("bad") or {}
    assert record.get("quarantine_release") == "drained", record
    sent = prefill.transfer_stats("bad") or {}
    assert sent["state"] == "failed", sent
    assert sent["num_writes"] < sent["num_writes_planned"], sent
    assert record["num_writes_landed"] == sent["num_writes"], (record, sent)
    assert "not posted" in final.error, final.error
    assert decode.submit("after", after, GREEDY, endpoint).result(30)[0] == expected_after
    assert_pools_full(prefill, decode, PREFILL_PAGES)


# -- 3. a decoder once marked failed ------------------------------------------------------------


def test_a_decoder_marked_failed_is_resolved_again_when_it_sends(
    tiny_model_dir: Path, pair: tuple[PrefillWorker, DecodeWorker]
) -> None:
    prefill, decode = pair
    warm, *later = prompts_of_lengths([40, 41, 42], seed=9)
    expected = reference(tiny_model_dir, later)
    endpoint = prefill.endpoint()
    assert decode.submit("warm", warm, GREEDY, endpoint).result(30)[1].error is None

    loop = prefill.fabric._loop
    peer = prefill.fabric.add_peer(decode.fabric.address)
    # NAMED FAULT INJECTION: the prefill fabric marks the decoder failed as its progress loop
    # does when an operation to it misses the operation deadline (a decoder stalled by SIGSTOP,
    # swap or a GC). The workers fix that deadline at 30 s, longer than a test can stall a
    # peer; the mark is the fabric's own, made on its progress thread.
    loop.call(lambda: loop.peers.fail(peer, OperationTimeoutError("injected: missed deadline")))
    assert isinstance(prefill.fabric.peer_failure(decode.fabric.address), OperationTimeoutError)

    # The decoder is alive: its next requests prove it, and are served.
    for index, (prompt, tokens) in enumerate(zip(later, expected, strict=True)):
        assert decode.submit(f"later{index}", prompt, GREEDY, endpoint).result(30)[0] == tokens
    assert prefill.fabric.peer_failure(decode.fabric.address) is None
    assert_pools_full(prefill, decode, PREFILL_PAGES)


# -- 4. another incarnation named for a live prefill --------------------------------------------


def test_a_stale_endpoint_frees_no_quarantined_page_of_a_live_prefill(tiny_model_dir: Path) -> None:
    slow_prefill = {"num_pages": DECODE_PAGES, "max_num_batched_tokens": 16}  # a page a pass
    prefill = RemotePrefill(tiny_model_dir, PROVIDER, engine=slow_prefill)
    decode = decode_worker(tiny_model_dir, timeout_s=2.0, drain_s=0.5)
    pid = prefill.process.pid or 0
    stopped = False
    try:
        warm, long_prompt, unversioned, forged, after = prompts_of_lengths(
            [40, 1600, 20, 21, 40], seed=13
        )
        expected_warm, expected_after = reference(tiny_model_dir, [warm, after])
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
            lambda: prefill_pool_full(prefill.state(), DECODE_PAGES),
            what="prefill pool full again",
        )
        assert decode_pool_full(decode, DECODE_PAGES)
    finally:
        if stopped:
            os.kill(pid, signal.SIGCONT)
        decode.close()
        assert prefill.close() == 0
