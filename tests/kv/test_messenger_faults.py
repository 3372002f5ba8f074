"""Deadlines, a killed prefill process, and aborts at every stage: no leak, no corruption."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.engine_helpers import make_engine, prompts_of_lengths, run_engine
from tests.kv.harness import RemotePrefill, decode_pages_back, decode_pool_full
from tests.waiting import wait_until
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams
from workers.fabric import OperationTimeoutError
from workers.kv.decode_messenger import DecodeMessengerConfig
from workers.service.kv_worker import DecodeWorker

PROVIDERS = ["tcp;ofi_rxm", "shm"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
DECODE_PAGES = 200
PREFILL_PAGES = 200
# One page per prefill pass: a long prompt takes ~100 passes, so there is time to act mid-way.
SLOW_PREFILL = {"num_pages": PREFILL_PAGES, "max_num_batched_tokens": 16}

pytestmark = pytest.mark.slow


def decode_worker(
    model_dir: Path, provider: str, timeout_s: float, drain_s: float, liveness_s: float = 1.0
) -> DecodeWorker:
    return DecodeWorker(
        model_dir,
        EngineConfig(num_pages=DECODE_PAGES),
        provider=provider,
        messenger_config=DecodeMessengerConfig(
            transfer_timeout_s=timeout_s, drain_interval_s=drain_s, liveness_interval_s=liveness_s
        ),
    )


def wait_for_landed_writes(decode: DecodeWorker, request_id: str) -> None:
    def landed() -> bool:
        progress = decode.transfer_progress(request_id)
        assert progress is not None, "the transfer ended before it could be interrupted"
        return progress[0] > 0

    wait_until(landed, what=f"first write of {request_id}")


def assert_freed_as_gone(decode: DecodeWorker, request_id: str) -> None:
    """The failed request's pages came back because its prefill process is gone, not by
    time: every page free, no transfer live, the release recorded as ``peer_gone``."""
    wait_until(lambda: decode_pool_full(decode, DECODE_PAGES), what="decode pool full again")
    record = decode.transfer_stats(request_id) or {}
    assert record.get("state") == "failed"
    assert record.get("quarantine_release") == "peer_gone", record


@pytest.mark.parametrize("provider", PROVIDERS)
def test_prefill_killed_mid_transfer_fails_after_deadline(
    tiny_model_dir: Path, provider: str
) -> None:
    prefill = RemotePrefill(tiny_model_dir, provider, engine=SLOW_PREFILL)
    # Liveness checks off: the deadline is what ends the request.
    decode = decode_worker(tiny_model_dir, provider, timeout_s=2.0, drain_s=0.5, liveness_s=0)
    try:
        (prompt,) = prompts_of_lengths([1600], seed=7)
        stream = decode.submit("k", prompt, GREEDY, prefill.endpoint)
        wait_for_landed_writes(decode, "k")
        prefill.kill()
        killed_at = time.monotonic()
        tokens, final = stream.result(30)
        assert tokens == [] and final.finish_reason == "error"
        # The decoder's own deadline: a killed prefill worker sends nothing (no PrefillFailed,
        # no done message), so nothing else can end the request.
        assert final.error is not None and "KV transfer deadline" in final.error, final.error
        assert time.monotonic() >= killed_at  # ordering only: the failure came after the kill
        # Freed because the process is known gone (tcp: nothing listens at its address any
        # more; shm: its process exited), not by time: no write of it can land any more.
        assert_freed_as_gone(decode, "k")
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_killed_prefill_process_is_noticed_before_the_deadline(
    tiny_model_dir: Path, provider: str
) -> None:
    """The decoder checks the prefill worker of a transfer that stopped moving: gone (tcp:
    nothing listens at its address; shm: its process exited), the request fails long before
    its deadline (an hour: a test that waited for it would time out) and its pages are freed."""
    prefill = RemotePrefill(tiny_model_dir, provider, engine=SLOW_PREFILL)
    decode = decode_worker(tiny_model_dir, provider, timeout_s=3600.0, drain_s=3600.0)
    try:
        (prompt,) = prompts_of_lengths([1600], seed=7)
        stream = decode.submit("k", prompt, GREEDY, prefill.endpoint)
        wait_for_landed_writes(decode, "k")
        prefill.kill()
        tokens, final = stream.result(60)
        assert tokens == [] and final.finish_reason == "error"
        assert final.error is not None and "prefill worker gone" in final.error, final.error
        assert_freed_as_gone(decode, "k")
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_killed_prefill_process_fails_hundreds_of_waiting_transfers(
    tiny_model_dir: Path, provider: str
) -> None:
    """Every transfer waiting on the dead worker fails at once and every page comes back,
    however many there are: ending each one used to judge the dead peer again for the next
    (shm: its exit is on record), and ~270 waiting at the kill exceeded Python's recursion
    limit and killed the decode step loop."""
    num_requests, num_pages = 450, 1000
    prefill = RemotePrefill(
        tiny_model_dir, provider, engine=SLOW_PREFILL, messenger={"max_transfers": 512}
    )
    decode = DecodeWorker(
        tiny_model_dir,
        EngineConfig(num_pages=num_pages),
        provider=provider,
        messenger_config=DecodeMessengerConfig(
            transfer_timeout_s=3600.0, drain_interval_s=3600.0, max_transfers=512
        ),
    )
    try:
        prompts = prompts_of_lengths([20] * num_requests, seed=9)
        streams = [
            decode.submit(f"w{i}", prompt, GREEDY, prefill.endpoint)
            for i, prompt in enumerate(prompts)
        ]
        wait_until(lambda: decode.imm_writes_received() > 0, what="a first write")
        prefill.kill()
        finals = [stream.result(120)[1] for stream in streams]
        failed = [f for f in finals if f.finish_reason == "error"]
        assert failed, "every request finished before the kill"
        assert all(f.error is not None and "prefill worker gone" in f.error for f in failed)
        # shm: a post that began before the death, to a prefill killed while it held its lock,
        # never returns; the fabric is then abandoned (the decoder unhealthy), but what was
        # offered to the dead process still comes back (test_fabric_abandoned).
        wait_until(lambda: decode_pages_back(decode, num_pages), what="decode pages all back")
    finally:
        decode.close()
        prefill.close()


def test_a_stopped_prefill_with_a_missed_deadline_on_record_is_not_gone(
    tiny_model_dir: Path,
) -> None:
    """A missed operation deadline is no proof of death: the liveness check asks the stopped
    prefill worker's listener (which still accepts), so its transfer waits, its pages stay
    its own, and once resumed it completes with the right tokens."""
    provider = "tcp;ofi_rxm"
    prefill = RemotePrefill(tiny_model_dir, provider, engine=SLOW_PREFILL)
    decode = decode_worker(tiny_model_dir, provider, 3600.0, 0.5, liveness_s=0.2)
    pid = prefill.process.pid or 0
    stopped = False
    try:
        (prompt,) = prompts_of_lengths([1600], seed=7)
        (expected,) = run_engine(make_engine(tiny_model_dir), [prompt], GREEDY)
        stream = decode.submit("paused", prompt, GREEDY, prefill.endpoint)
        wait_for_landed_writes(decode, "paused")
        os.kill(pid, signal.SIGSTOP)
        stopped = True
        # NAMED FAULT INJECTION: the decoder's fabric records a missed deadline for the stopped
        # prefill worker, as its progress loop does when an operation to it outlives the
        # operation deadline (30 s in the workers, longer than a test stops a process).
        loop = decode.fabric._loop
        peer = decode.fabric.add_peer(prefill.endpoint.address)
        loop.call(lambda: loop.peers.fail(peer, OperationTimeoutError("injected: missed deadline")))
        time.sleep(2.0)  # ten liveness looks: time alone fails nothing
        assert decode.transfer_progress("paused") is not None, decode.transfer_stats("paused")
        os.kill(pid, signal.SIGCONT)
        stopped = False
        tokens, final = stream.result(60)
        assert (tokens, final.error) == (expected, None)
        wait_until(lambda: decode_pool_full(decode, DECODE_PAGES), what="decode pool full again")
    finally:
        if stopped:
            os.kill(pid, signal.SIGCONT)
        decode.close()
        prefill.close()


class Setup:
    def __init__(self, model_dir: Path, provider: str) -> None:
        self.model_dir = model_dir
        self.prefill = RemotePrefill(model_dir, provider, engine=SLOW_PREFILL)
        self.decode = decode_worker(model_dir, provider, timeout_s=30.0, drain_s=30.0)

    def pools_full(self) -> None:
        # drain_s is long: pages only come back early through acknowledged or landed writes.
        wait_until(
            lambda: decode_pool_full(self.decode, DECODE_PAGES), what="decode pool full again"
        )
        wait_until(
            lambda: self.prefill.state()["num_free_pages"] == PREFILL_PAGES,
            what="prefill pool full again",
        )
        assert self.prefill.state()["num_transfers"] == 0
        assert self.decode.state()["num_transfers"] == 0


# Both providers on the Llama preset; DeepSeek's latent pages (MLA) on tcp.
@pytest.fixture(
    scope="module",
    params=[(p, "tiny") for p in PROVIDERS] + [("tcp;ofi_rxm", "deepseek")],
    ids=lambda p: f"{p[1]}-{p[0]}",
)
def setup(request: pytest.FixtureRequest) -> Iterator[Setup]:
    provider, model = request.param
    setup = Setup(Path(request.getfixturevalue(f"{model}_model_dir")), provider)
    yield setup
    setup.decode.close()
    assert setup.prefill.close() == 0


def test_abort_during_prefill_and_transfer(setup: Setup) -> None:
    decode, endpoint = setup.decode, setup.prefill.endpoint
    long_prompt, later = prompts_of_lengths([1600, 700], seed=8)

    # During prefill: the abort overtakes the request (queued or in its first passes).
    stream = decode.submit("a-prefill", long_prompt, GREEDY, endpoint)
    assert decode.abort("a-prefill")
    assert stream.result(10)[1].finish_reason == "abort"

    # During the transfer: some layers' writes have landed.
    stream = decode.submit("a-transfer", long_prompt, GREEDY, endpoint)
    wait_for_landed_writes(decode, "a-transfer")
    assert decode.abort("a-transfer")
    assert stream.result(10)[1].finish_reason == "abort"
    setup.pools_full()
    assert setup.prefill.stats("a-transfer")["state"] == "cancelled"

    # A later request reuses the freed pages (and slots) and must decode correctly.
    (expected,) = run_engine(make_engine(setup.model_dir), [later], GREEDY)
    tokens, final = decode.submit("after", later, GREEDY, endpoint).result(60)
    assert tokens == expected, final.error
    setup.pools_full()


def test_aborts_around_completion(setup: Setup) -> None:
    decode, endpoint = setup.decode, setup.prefill.endpoint
    prompts = prompts_of_lengths([17, 40, 33, 64, 20, 50], seed=9)
    expected = run_engine(make_engine(setup.model_dir), prompts, GREEDY)
    # Sweep the abort over the moment the counter fires: before, at, just after.
    reasons = set()
    for i, prompt in enumerate(prompts):
        stream = decode.submit(f"z{i}", prompt, GREEDY, endpoint)
        time.sleep(0.004 * i)
        decode.abort(f"z{i}")
        reasons.add(stream.result(30)[1].finish_reason)
    assert reasons <= {"abort", "length"}
    setup.pools_full()
    # Every page is reused by a new round: no late write of the aborted round corrupts it.
    streams = [decode.submit(f"y{i}", p, GREEDY, endpoint) for i, p in enumerate(prompts)]
    assert [s.result(60)[0] for s in streams] == expected
    setup.pools_full()


def test_rejected_request_fails_fast_and_frees_its_pages(tiny_model_dir: Path) -> None:
    provider = "tcp;ofi_rxm"
    prefill = RemotePrefill(tiny_model_dir, provider, engine={"num_pages": 8})  # 128 tokens
    decode = decode_worker(tiny_model_dir, provider, timeout_s=30.0, drain_s=30.0)
    try:
        too_long, fits = prompts_of_lengths([500, 40], seed=10)
        tokens, final = decode.submit("big", too_long, GREEDY, prefill.endpoint).result(10)
        assert tokens == [] and final.finish_reason == "error"
        assert final.error is not None and "TOO_LONG" in final.error, final.error
        # Nothing was written: the pages come back at once, with no abort to acknowledge.
        wait_until(
            lambda: decode_pool_full(decode, DECODE_PAGES), timeout=5.0, what="decode pool full"
        )
        (expected,) = run_engine(make_engine(tiny_model_dir), [fits], GREEDY)
        assert decode.submit("small", fits, GREEDY, prefill.endpoint).result(30)[0] == expected
    finally:
        decode.close()
        assert prefill.close() == 0
