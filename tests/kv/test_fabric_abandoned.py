"""A decoder whose fabric was abandoned (a post to a prefill worker never returned).

On shm, a prefill process stopped while it held its region lock blocks every post to it; the
fabric's watchdog then abandons the engine, and the peer it was posting to is failed with a
`PeerStuckError`. That proves nothing about the prefill process: resumed, it goes on writing
into the pages it was offered. So the decoder keeps those pages for good (it can neither send
an abort nor hear the answer any more), fails every request now rather than at its deadline,
refuses new ones (UNAVAILABLE: the router sends them to another decoder) and reports itself
unhealthy, so the control plane replaces it.

Real workers on the tiny preset over ``tcp`` (real engines, real libfabric). The stuck post is
a NAMED TEST FAULT (`tests.fabric.harness.StuckPosts`): one fabric's posts block once armed.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.engine.engine_helpers import prompts_of_lengths
from tests.fabric.harness import StuckPosts
from tests.kv.harness import wait_until
from workers.engine.config import EngineConfig
from workers.engine.errors import EngineClosedError
from workers.engine.sampling_params import SamplingParams
from workers.fabric import PeerStuckError, progress, watchdog
from workers.kv.decode_messenger import DecodeMessengerConfig
from workers.kv.worker import DecodeWorker, PrefillWorker

PROVIDER = "tcp;ofi_rxm"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
DECODE_PAGES = 200
PREFILL_PAGES = 200
WAIT_S = 60.0  # far below the decoder's transfer deadline
TRANSFER_DEADLINE_S = 3600.0
DRAIN_S = 0.2

pytestmark = pytest.mark.slow


def _pair(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, transfer_deadline_s: float
) -> tuple[PrefillWorker, DecodeWorker]:
    """A prefill and a decode worker, with a watchdog that abandons a fabric within ~0.5 s."""
    monkeypatch.setattr(watchdog, "_STALL_S", 0.5)
    monkeypatch.setattr(watchdog, "_WATCHDOG_PERIOD_S", 0.05)
    # One page per pass: a long prompt takes ~100 passes, so its transfer is mid-way when
    # the tests act.
    prefill = PrefillWorker(
        model_dir,
        EngineConfig(num_pages=PREFILL_PAGES, max_num_batched_tokens=16),
        provider=PROVIDER,
    )
    decode = DecodeWorker(
        model_dir,
        EngineConfig(num_pages=DECODE_PAGES),
        provider=PROVIDER,
        messenger_config=DecodeMessengerConfig(
            transfer_timeout_s=transfer_deadline_s, drain_interval_s=DRAIN_S
        ),
    )
    return prefill, decode


def test_an_abandoned_decoder_fabric_keeps_offered_pages_and_refuses_work(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefill, decode = _pair(tiny_model_dir, monkeypatch, TRANSFER_DEADLINE_S)
    # The prefill worker's own writes into the abandoned decoder (which reads nothing any
    # more) end at this deadline, so its pages come back within the test.
    prefill.fabric.op_timeout = 2.0
    stuck = StuckPosts(progress.lib, decode.fabric.threads[0])
    monkeypatch.setattr(progress, "lib", stuck)
    try:
        long_prompt, other_prompt, late_prompt = prompts_of_lengths([1600, 1200, 40], seed=5)
        offered = decode.submit("offered", long_prompt, GREEDY, prefill.endpoint())

        def landed() -> bool:
            progress_now = decode.transfer_progress("offered")
            assert progress_now is not None, "the transfer ended before the fault"
            return progress_now[0] > 0

        wait_until(landed, what="first write of the offered transfer")
        waiting = decode.submit("waiting", other_prompt, GREEDY, prefill.endpoint())
        wait_until(lambda: decode.transfer_progress("waiting") is not None, what="second sent")

        # Its AbortPrefill is the post that never returns: the watchdog abandons the fabric.
        stuck.armed.set()
        decode.abort("offered")
        assert stuck.entered.wait(WAIT_S)
        wait_until(lambda: decode.fabric.closed_reason() is not None, what="fabric abandoned")
        assert isinstance(decode.fabric.peer_failure(prefill.fabric.address), PeerStuckError)

        # The request still waiting fails now, with the cause, not at its deadline.
        tokens, final = waiting.result(WAIT_S)
        assert tokens == [] and final.finish_reason == "error"
        assert final.error is not None and "KV fabric unusable" in final.error
        assert offered.result(WAIT_S)[1].finish_reason == "abort"

        # Both page sets were offered to a live prefill worker: they stay held, time frees
        # nothing, and no page of them can be handed out (nothing is admitted any more).
        held: set[int] = set()
        for request_id in ("offered", "waiting"):
            record = decode.transfer_stats(request_id) or {}
            assert record.get("state") == "failed", record
            held |= set(record["page_ids"])
        time.sleep(10 * DRAIN_S)
        for request_id in ("offered", "waiting"):
            assert "quarantine_release" not in (decode.transfer_stats(request_id) or {})
        assert decode.engine.block_manager.num_pinned_pages == len(held) > 0
        # Unhealthy (the health check's call raises) and refusing: nothing is allocated.
        with pytest.raises(EngineClosedError, match="KV fabric unusable"):
            decode.state()
        with pytest.raises(EngineClosedError, match="KV fabric unusable"):
            decode.submit("late", late_prompt, GREEDY, prefill.endpoint())
        assert decode.engine.block_manager.num_pinned_pages == len(held)
        # The prefill worker's writes into the decoder missed their deadline: it gave up.
        wait_until(
            lambda: prefill.state()["num_free_pages"] == PREFILL_PAGES,
            timeout=WAIT_S,
            what="prefill pool full again",
        )
    finally:
        # The stuck post returns (a stopped prefill resumed), then the worker closes: its
        # abandoned endpoint is left open, not closed under a provider nothing polled.
        stuck.release.set()
        decode.close()
        prefill.close(drain_timeout_s=2.0)


def test_a_prefill_worker_whose_fabric_was_abandoned_reports_itself_unhealthy(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its writes into a decoder stop for good: its `state` (the health check's call) raises
    from then on. The decoder, hearing nothing more, fails the request at its deadline and
    keeps the pages: the prefill process is alive, so its writes could still land."""
    prefill, decode = _pair(tiny_model_dir, monkeypatch, 3.0)
    stuck = StuckPosts(progress.lib, prefill.fabric.threads[0])
    monkeypatch.setattr(progress, "lib", stuck)
    try:
        (prompt,) = prompts_of_lengths([1600], seed=6)
        stream = decode.submit("mute", prompt, GREEDY, prefill.endpoint())
        wait_until(lambda: (decode.transfer_progress("mute") or (0, 0))[0] > 0, what="a write")
        stuck.armed.set()
        assert stuck.entered.wait(WAIT_S)
        wait_until(lambda: prefill.fabric.closed_reason() is not None, what="fabric abandoned")
        with pytest.raises(EngineClosedError, match="KV fabric unusable"):
            prefill.state()

        tokens, final = stream.result(WAIT_S)
        assert tokens == [] and final.error is not None and "deadline" in final.error
        record = decode.transfer_stats("mute") or {}
        time.sleep(10 * DRAIN_S)
        assert decode.state()["num_quarantined_pages"] == len(record["page_ids"]) > 0
        assert "quarantine_release" not in (decode.transfer_stats("mute") or {})
    finally:
        stuck.release.set()
        decode.close()
        prefill.close(drain_timeout_s=1.0)
