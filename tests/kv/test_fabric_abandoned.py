"""A decoder whose fabric was abandoned (a post to a prefill worker never returned).

On shm, a prefill process stopped while it held its region lock blocks every post to it; the
fabric's watchdog then abandons the engine, and the peer it was posting to is failed with a
`PeerStuckError`. That proves nothing about the prefill process: resumed, it goes on writing
into the pages it was offered. So the decoder keeps those pages for good (it can neither send
an abort nor hear the answer any more), fails every request now rather than at its deadline,
refuses new ones (UNAVAILABLE: the router sends them to another decoder) and reports itself
unhealthy, so the control plane replaces it. A counter the abandoned fabric disarmed is no
proof that its writes landed (the pages stay held), and a `PrefillAccepted` handled after the
fabric closed fails its request, never the step loop.

A prefill process killed while the decoder's post to it is stuck (on shm: killed while it held
its lock) is another matter: its exit is proof, so what it was offered is freed.

Real workers on the tiny preset over ``tcp`` (the killed prefill: a process of its own, over
``shm``; real engines, real libfabric). The stuck post is a NAMED TEST FAULT (`tests.fabric.harness.StuckPosts`): one fabric's posts block once armed.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.engine.engine_helpers import prompts_of_lengths
from tests.fabric.harness import StuckPosts
from tests.kv.harness import RemotePrefill
from tests.waiting import wait_until
from workers.engine.config import EngineConfig
from workers.engine.errors import EngineClosedError
from workers.engine.sampling_params import SamplingParams
from workers.fabric import PeerFailedError, PeerStuckError, progress, watchdog
from workers.kv.decode_messenger import DecodeMessengerConfig
from workers.service.kv_worker import DecodeWorker, PrefillWorker

PROVIDER = "tcp;ofi_rxm"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
DECODE_PAGES = 200
PREFILL_PAGES = 200
WAIT_S = 60.0  # far below the decoder's transfer deadline
TRANSFER_DEADLINE_S = 3600.0
DRAIN_S = 0.2

pytestmark = pytest.mark.slow


def _pair(
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    transfer_deadline_s: float,
    *,
    coalesce_pages: bool = True,
) -> tuple[PrefillWorker, DecodeWorker]:
    """A prefill and a decode worker, with a watchdog that abandons a fabric within ~0.5 s;
    ``coalesce_pages=False``: the decoder knows the write count and arms at once."""
    monkeypatch.setattr(watchdog, "_STALL_S", 0.5)
    monkeypatch.setattr(watchdog, "_WATCHDOG_PERIOD_S", 0.05)
    # One page per pass: a long prompt takes ~100 passes, so its transfer is mid-way when
    # the tests act.
    prefill = PrefillWorker(
        model_dir,
        EngineConfig(num_pages=PREFILL_PAGES, max_num_batched_tokens=16),
        provider=PROVIDER,
    )
    try:
        decode = DecodeWorker(
            model_dir,
            EngineConfig(num_pages=DECODE_PAGES),
            provider=PROVIDER,
            messenger_config=DecodeMessengerConfig(
                transfer_timeout_s=transfer_deadline_s,
                drain_interval_s=DRAIN_S,
                coalesce_pages=coalesce_pages,
            ),
        )
    except BaseException:
        prefill.close()
        raise
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


def test_an_armed_transfer_keeps_its_pages_when_the_decoder_fabric_is_abandoned(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without coalescing the decoder arms at once; with writes landed, the fabric is
    abandoned and `fail_all` disarms the counter. That is no fire: the pages stay held."""
    prefill, decode = _pair(tiny_model_dir, monkeypatch, TRANSFER_DEADLINE_S, coalesce_pages=False)
    prefill.fabric.op_timeout = 2.0  # its writes into the abandoned decoder end
    stuck = StuckPosts(progress.lib, decode.fabric.threads[0])
    monkeypatch.setattr(progress, "lib", stuck)
    try:
        armed_prompt, trigger_prompt = prompts_of_lengths([1600, 40], seed=11)
        armed = decode.submit("armed", armed_prompt, GREEDY, prefill.endpoint())

        def landed() -> bool:
            now = decode.transfer_progress("armed")
            assert now is not None, "the transfer ended before the fault"
            return now[0] > 0 and now[1] is not None  # armed: the decoder knows the count

        wait_until(landed, what="first write of the armed transfer")
        # The next PrefillRequest is the post that never returns: the fabric is abandoned.
        stuck.armed.set()
        trigger = decode.submit("trigger", trigger_prompt, GREEDY, prefill.endpoint())
        assert stuck.entered.wait(WAIT_S)
        wait_until(lambda: decode.fabric.closed_reason() is not None, what="fabric abandoned")

        held: set[int] = set()
        for request_id, stream in (("armed", armed), ("trigger", trigger)):
            tokens, final = stream.result(WAIT_S)
            assert tokens == [] and final.error is not None
            assert "KV fabric unusable" in final.error
            record = decode.transfer_stats(request_id) or {}
            assert record.get("state") == "failed", record
            held |= set(record["page_ids"])
        time.sleep(10 * DRAIN_S)  # several re-send intervals: time alone frees nothing
        for request_id in ("armed", "trigger"):
            assert "quarantine_release" not in (decode.transfer_stats(request_id) or {})
        assert decode.engine.block_manager.num_pinned_pages == len(held) > 0
    finally:
        stuck.release.set()
        decode.close()
        prefill.close(drain_timeout_s=2.0)


def test_a_prefill_accepted_handled_after_the_fabric_closed_fails_its_request(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The `PrefillAccepted` is in the decoder's inbox when its fabric is abandoned (the step
    thread is held meanwhile); arming then raises, which must fail the request, not the step
    loop."""
    prefill, decode = _pair(tiny_model_dir, monkeypatch, TRANSFER_DEADLINE_S)
    prefill.fabric.op_timeout = 2.0
    stuck = StuckPosts(progress.lib, decode.fabric.threads[0])
    monkeypatch.setattr(progress, "lib", stuck)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait(WAIT_S)

    holder = threading.Thread(target=decode._loop.call, args=(hold,))
    try:
        (prompt,) = prompts_of_lengths([400], seed=12)
        stream = decode.submit("r", prompt, GREEDY, prefill.endpoint())
        wait_until(lambda: (decode.transfer_progress("r") or (0, 0))[0] > 0, what="a write")
        holder.start()
        assert held.wait(WAIT_S)
        inbox = decode.messenger._inbox
        wait_until(lambda: inbox.qsize() >= 1, timeout=WAIT_S, what="PrefillAccepted queued")
        stuck.armed.set()  # a send from here is the post that never returns
        decode.fabric.submit_send(decode.fabric.add_peer(prefill.endpoint().address), b"x")
        assert stuck.entered.wait(WAIT_S)
        wait_until(lambda: decode.fabric.closed_reason() is not None, what="fabric abandoned")
        release.set()
        holder.join(WAIT_S)

        tokens, final = stream.result(WAIT_S)
        assert tokens == [] and final.error is not None
        assert final.error.startswith("KV fabric unusable"), final.error  # not a dead loop
        record = decode.transfer_stats("r") or {}  # the step loop still answers
        assert record.get("state") == "failed", record
        pinned = decode.engine.block_manager.num_pinned_pages
        if "quarantine_release" in record:  # every write had landed: nothing can come
            assert record["num_writes_landed"] == record["num_writes_expected"], record
            assert pinned == 0
        else:
            assert pinned == len(record["page_ids"]) > 0
        with pytest.raises(EngineClosedError, match="KV fabric unusable"):
            decode.state()
    finally:
        release.set()
        if holder.is_alive():
            holder.join(WAIT_S)
        stuck.release.set()
        decode.close()
        prefill.close(drain_timeout_s=2.0)


def test_a_decoder_stuck_posting_to_a_killed_prefill_frees_the_pages_it_offered_it(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On shm a prefill process killed while it holds its region lock blocks, for good, a
    post of the decoder's that began before its death (its exit is then noticed only by the
    thread that is stuck). The watchdog abandons the fabric, but the peer's watched process
    has exited: that is proof of death, so its transfers fail as gone and every page comes
    back. The decoder stays unhealthy: its progress thread never returns."""
    monkeypatch.setattr(watchdog, "_STALL_S", 2.0)  # the kill below completes well within it
    monkeypatch.setattr(watchdog, "_WATCHDOG_PERIOD_S", 0.05)
    prefill = RemotePrefill(
        tiny_model_dir, "shm", engine={"num_pages": PREFILL_PAGES, "max_num_batched_tokens": 16}
    )
    decode = DecodeWorker(
        tiny_model_dir,
        EngineConfig(num_pages=DECODE_PAGES),
        provider="shm",
        messenger_config=DecodeMessengerConfig(
            transfer_timeout_s=TRANSFER_DEADLINE_S, drain_interval_s=DRAIN_S
        ),
    )
    stuck = StuckPosts(progress.lib, decode.fabric.threads[0])
    monkeypatch.setattr(progress, "lib", stuck)
    try:
        long_prompt, other_prompt = prompts_of_lengths([1600, 1200], seed=5)
        offered = decode.submit("offered", long_prompt, GREEDY, prefill.endpoint)
        wait_until(
            lambda: (decode.transfer_progress("offered") or (0, 0))[0] > 0,
            what="first write of the offered transfer",
        )
        waiting = decode.submit("waiting", other_prompt, GREEDY, prefill.endpoint)
        wait_until(lambda: decode.transfer_progress("waiting") is not None, what="second sent")

        stuck.armed.set()
        decode.abort("offered")  # its AbortPrefill is the post that never returns
        assert stuck.entered.wait(WAIT_S)
        prefill.kill()
        wait_until(lambda: decode.fabric.closed_reason() is not None, what="fabric abandoned")
        failure = decode.fabric.peer_failure(prefill.endpoint.address)
        assert type(failure) is PeerFailedError, failure  # not the stuck post's PeerStuckError

        tokens, final = waiting.result(WAIT_S)
        assert tokens == [] and final.finish_reason == "error"
        assert final.error is not None and "prefill worker gone" in final.error, final.error
        assert offered.result(WAIT_S)[1].finish_reason == "abort"
        block_manager = decode.engine.block_manager
        wait_until(
            lambda: (
                block_manager.num_free_pages == DECODE_PAGES and block_manager.num_pinned_pages == 0
            ),
            what="decode pool full again",
        )
        for request_id in ("offered", "waiting"):
            record = decode.transfer_stats(request_id) or {}
            assert record.get("quarantine_release") == "peer_gone", record
        with pytest.raises(EngineClosedError, match="KV fabric unusable"):
            decode.state()
    finally:
        stuck.release.set()
        decode.close()
        prefill.close()
