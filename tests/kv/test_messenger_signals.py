"""Outputs through ``on_output``, the admission deadline of a request waiting for decode pages,
and a prefill worker's failure (graceful shutdown) reaching the decoder at once."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.engine.engine_helpers import prompts_of_lengths
from tests.kv.harness import RemotePrefill
from tests.waiting import wait_until
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams
from workers.fabric import Message, TransferEngine
from workers.kv.decode_messenger import DecodeMessengerConfig
from workers.kv.endpoint import PrefillEndpoint
from workers.kv.protocol import (
    FailReason,
    PrefillFailed,
    PrefillRejected,
    PrefillRequest,
    RejectReason,
    decode_message,
    encode_message,
)
from workers.kv.protocol import Message as ProtocolMessage
from workers.service.kv_worker import DecodeWorker, WorkerOutput

PROVIDER = "tcp;ofi_rxm"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

pytestmark = pytest.mark.slow


class FakePrefill:
    """A bare fabric endpoint posing as a prefill worker: it keeps the `PrefillRequest`s it gets
    and answers only when told (so a request holds its decode pages as long as a test wants)."""

    def __init__(self, decode: DecodeWorker) -> None:
        self.fabric = TransferEngine(PROVIDER, "127.0.0.1")
        self.requests: list[tuple[PrefillRequest, bytes]] = []
        self._lock = threading.Lock()
        self.fabric.on_message(self._on_message)
        model = decode.engine.model_config
        self.endpoint = PrefillEndpoint(
            self.fabric.address, self.fabric.provider, 1, model.num_kv_heads, False, 0, 16
        )

    def _on_message(self, message: Message) -> None:
        decoded = decode_message(message.payload)
        if isinstance(decoded, PrefillRequest):
            with self._lock:
                self.requests.append((decoded, message.source))

    def num_requests(self) -> int:
        with self._lock:
            return len(self.requests)

    def reject_all(self) -> None:
        self._answer_all(
            lambda r: PrefillRejected(r.request_id, r.transfer_id, RejectReason.INTERNAL, "test")
        )

    def fail_all(self, reason: FailReason, detail: str) -> None:
        self._answer_all(lambda r: PrefillFailed(r.request_id, r.transfer_id, reason, 0, detail))

    def _answer_all(self, answer: Callable[[PrefillRequest], ProtocolMessage]) -> None:
        with self._lock:
            requests, self.requests = self.requests, []
        for request, source in requests:
            peer = self.fabric.add_peer(source)
            self.fabric.submit_send(peer, encode_message(answer(request)))

    def close(self) -> None:
        self.fabric.close()


def decode_worker(model_dir: Path, num_pages: int, **messenger: float) -> DecodeWorker:
    return DecodeWorker(
        model_dir,
        EngineConfig(num_pages=num_pages),
        provider=PROVIDER,
        messenger_config=DecodeMessengerConfig(**messenger),  # type: ignore[arg-type]
    )


def pool_full(decode: DecodeWorker, num_pages: int) -> bool:
    state = decode.state()
    return state["num_free_pages"] == num_pages and state["num_pinned_pages"] == 0


@contextlib.contextmanager
def small_decode_with_fake(
    model_dir: Path, **messenger: float
) -> Iterator[tuple[DecodeWorker, FakePrefill]]:
    """An 8-page decode worker (long deadline and drain time) and a fake prefill worker."""
    decode = decode_worker(
        model_dir, 8, transfer_timeout_s=60.0, drain_interval_s=60.0, **messenger
    )
    fake = FakePrefill(decode)
    try:
        yield decode, fake
    finally:
        decode.close()
        fake.close()


@pytest.fixture
def small_decode(tiny_model_dir: Path) -> Iterator[tuple[DecodeWorker, FakePrefill]]:
    with small_decode_with_fake(tiny_model_dir) as pair:
        yield pair


def test_on_output_gets_every_output_on_the_step_thread(
    small_decode: tuple[DecodeWorker, FakePrefill],
) -> None:
    decode, fake = small_decode
    got: list[tuple[WorkerOutput, str, bool]] = []
    done = threading.Event()

    def on_output(output: WorkerOutput) -> None:
        # Runs where the engine step produced it: the final output is not held back for a
        # poll or a health interval.
        step = threading.current_thread().name == "decode-step"
        got.append((output, threading.current_thread().name, step))
        if output.finished:
            done.set()

    # A one-token prompt goes straight to the engine: no prefill needed.
    stream = decode.submit("cb", [5], GREEDY, fake.endpoint, on_output=on_output)
    assert done.wait(30), "no finished output"
    assert all(on_step for _, _, on_step in got), got
    assert [o.finished for o, _, _ in got] == [False] * (len(got) - 1) + [True]
    assert sum(len(o.new_token_ids) for o, _, _ in got) == GREEDY.max_tokens
    assert got[-1][0].finish_reason == "length"
    # The outputs went to the callback, not to the stream's queue.
    with pytest.raises(queue.Empty):
        stream.get(timeout=0)
    # Without a callback the stream API is unchanged.
    tokens, final = decode.submit("st", [5], GREEDY, fake.endpoint).result(30)
    assert tokens == [t for o, _, _ in got for t in o.new_token_ids]
    assert final.finish_reason == "length"


def test_request_waiting_for_decode_pages_fails_at_its_admission_deadline(
    tiny_model_dir: Path,
) -> None:
    with small_decode_with_fake(tiny_model_dir, admission_timeout_s=0.5) as (decode, fake):
        check_admission_deadline(decode, fake)


def check_admission_deadline(decode: DecodeWorker, fake: FakePrefill) -> None:
    long_prompt, short_prompt = prompts_of_lengths([100, 60], seed=3)
    # 7 of the 8 pages stay pinned: the fake prefill worker never answers.
    first = decode.submit("long", long_prompt, GREEDY, fake.endpoint)
    wait_until(lambda: fake.num_requests() == 1, what="the long request's PrefillRequest")
    before = decode.state()
    assert before["num_pinned_pages"] == 7 and before["num_free_pages"] == 1

    tokens, final = decode.submit("short", short_prompt, GREEDY, fake.endpoint).result(20)
    assert tokens == [] and final.finish_reason == "error"
    assert final.error is not None and "admission deadline" in final.error, final.error
    after = decode.state()
    assert after["num_pinned_pages"] == 7 and after["num_free_pages"] == 1
    assert after["num_transfers"] == 1 and after["num_quarantined_pages"] == 0
    assert fake.num_requests() == 1  # the short one never asked for KV

    # The long request still ends normally (here: rejected) and the pool is full again.
    fake.reject_all()
    assert first.result(20)[1].finish_reason == "error"
    wait_until(lambda: pool_full(decode, 8), timeout=10, what="decode pool full")


def test_prefill_failed_ends_the_request_at_once_and_frees_its_pages(
    small_decode: tuple[DecodeWorker, FakePrefill],
) -> None:
    decode, fake = small_decode
    (prompt,) = prompts_of_lengths([100], seed=4)
    stream = decode.submit("f", prompt, GREEDY, fake.endpoint)
    wait_until(lambda: fake.num_requests() == 1, what="the PrefillRequest")
    fake.fail_all(FailReason.WRITE_ERROR, "link down")
    # The decoder's deadline (60 s) and drain time (60 s) are far beyond these waits.
    tokens, final = stream.result(20)
    assert tokens == [] and final.finish_reason == "error"
    assert final.error == "prefill worker failed the request (WRITE_ERROR: link down)"
    wait_until(lambda: pool_full(decode, 8), timeout=10, what="decode pool full (0 writes)")
    assert (decode.transfer_stats("f") or {}).get("state") == "failed"


def test_prefill_shutdown_fails_decoder_requests_at_once(tiny_model_dir: Path) -> None:
    num_pages = 200
    # One page per prefill pass (the long prompt takes ~100 passes); 120 prefill pages: the
    # second request stays queued behind the first.
    prefill = RemotePrefill(
        tiny_model_dir, PROVIDER, engine={"num_pages": 120, "max_num_batched_tokens": 16}
    )
    # Deadline and drain time far beyond the waits below: only PrefillFailed can end these
    # requests and only the acknowledged write count can free their pages in time.
    decode = decode_worker(
        tiny_model_dir, num_pages, transfer_timeout_s=120.0, drain_interval_s=120.0
    )
    try:
        long_prompt, queued_prompt = prompts_of_lengths([1600, 500], seed=11)
        running = decode.submit("running", long_prompt, GREEDY, prefill.endpoint)

        def landed() -> bool:
            progress = decode.transfer_progress("running")
            assert progress is not None, "the transfer ended before the shutdown"
            return progress[0] > 0

        wait_until(landed, what="first write of the running request")
        queued = decode.submit("queued", queued_prompt, GREEDY, prefill.endpoint)
        wait_until(
            lambda: prefill.state()["num_queued"] == 1, what="second request queued at prefill"
        )

        assert prefill.close() == 0  # graceful: the worker drains, then exits
        for stream in (running, queued):
            tokens, final = stream.result(20)
            assert tokens == [] and final.finish_reason == "error"
            assert final.error is not None
            assert "prefill worker failed the request (DRAINING" in final.error, final.error
        wait_until(lambda: pool_full(decode, num_pages), timeout=20, what="decode pool full")
        state = decode.state()
        assert state["num_transfers"] == 0 and state["num_quarantined_pages"] == 0
        assert (decode.transfer_stats("running") or {}).get("state") == "failed"
    finally:
        decode.close()
        prefill.close()
