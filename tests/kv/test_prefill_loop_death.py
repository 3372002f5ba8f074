"""A prefill worker whose step loop dies mid-transfer tells its decoders at once.

Real workers on the tiny preset over ``tcp`` (real engines, real libfabric). The decoder's
transfer deadline is set far beyond the test's waits, so a decoder that only learnt of the
failure at its deadline fails the test. The death itself is a NAMED TEST FAULT: an engine step
that raises after it ran (a bug or a device error cannot be produced on demand).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.engine_helpers import make_engine, prompts_of_lengths, run_engine
from tests.kv.harness import decode_pool_full
from tests.waiting import wait_until
from workers.engine.config import EngineConfig
from workers.engine.errors import EngineClosedError
from workers.engine.sampling_params import SamplingParams
from workers.kv.decode_messenger import DecodeMessengerConfig
from workers.service.kv_worker import DecodeWorker, PrefillWorker

PROVIDER = "tcp;ofi_rxm"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
DECODE_PAGES = 200
PREFILL_PAGES = 64
CHUNK_TOKENS = 64  # the 300-token prompt takes 5 passes: writes are in flight when it dies
WAIT_S = 60.0  # far below the decoder's transfer deadline
TRANSFER_DEADLINE_S = 3600.0

pytestmark = pytest.mark.slow


def _prefill(model_dir: Path) -> PrefillWorker:
    config = EngineConfig(
        num_pages=PREFILL_PAGES, max_num_batched_tokens=CHUNK_TOKENS, enable_chunked_prefill=True
    )
    return PrefillWorker(model_dir, config, provider=PROVIDER)


@pytest.fixture
def decode(tiny_model_dir: Path) -> Iterator[DecodeWorker]:
    worker = DecodeWorker(
        tiny_model_dir,
        EngineConfig(num_pages=DECODE_PAGES),
        provider=PROVIDER,
        messenger_config=DecodeMessengerConfig(
            transfer_timeout_s=TRANSFER_DEADLINE_S, drain_interval_s=0.2
        ),
    )
    yield worker
    worker.close()


def _fail_in_pass(prefill: PrefillWorker, pass_number: int) -> None:
    """NAMED TEST FAULT: the prefill engine's forward pass ``pass_number`` raises in its second
    layer (a bug or a device error cannot be produced on demand): the earlier passes' writes
    are submitted, and this pass is planned for the push thread but never ends."""
    engine = prefill.engine

    def fail(module: object, args: object, output: object) -> None:
        if engine.stats.num_steps + 1 >= pass_number:  # counted once the pass returned
            raise RuntimeError("injected prefill step failure")

    engine.model.layers[1].register_forward_hook(fail)


def test_a_dead_prefill_loop_fails_its_transfers_at_once_and_refuses_new_ones(
    tiny_model_dir: Path, decode: DecodeWorker
) -> None:
    long_prompt, short_prompt = prompts_of_lengths([300, 40])
    dead = _prefill(tiny_model_dir)
    healthy = _prefill(tiny_model_dir)
    try:
        _fail_in_pass(dead, 2)
        tokens, final = decode.submit("mid", long_prompt, GREEDY, dead.endpoint()).result(WAIT_S)
        assert tokens == [] and final.finish_reason == "error"
        assert final.error is not None
        assert "ENGINE_ERROR" in final.error and "injected prefill step failure" in final.error
        # The first pass's writes had been submitted: the decoder counted them in before freeing.
        record = decode.transfer_stats("mid")
        assert record is not None and record["state"] == "failed"
        assert record["num_writes_landed"] > 0 and record["quarantine_release"] == "drained"
        wait_until(lambda: decode_pool_full(decode, DECODE_PAGES), what="decode pool full again")

        # The pass it died in will never end: the push thread was told so, it does not wait.
        wait_until(lambda: dead.messenger.push_idle, what="push thread idle")
        # The worker is unhealthy (its state raises, as the health check sees it) but still
        # answers: a new request is refused with the cause, nothing allocated for it.
        with pytest.raises(EngineClosedError, match="injected prefill step failure"):
            dead.state()
        tokens, final = decode.submit("late", short_prompt, GREEDY, dead.endpoint()).result(WAIT_S)
        assert tokens == [] and final.finish_reason == "error"
        assert final.error is not None and "INTERNAL" in final.error
        assert "prefill engine failed" in final.error
        wait_until(lambda: decode_pool_full(decode, DECODE_PAGES), what="decode pool full again")

        # The same decoder, its pages reused, serves both prompts from a healthy prefill worker.
        expected = run_engine(make_engine(tiny_model_dir), [long_prompt, short_prompt], GREEDY)
        for request_id, prompt, want in zip(
            ("again-long", "again-short"), (long_prompt, short_prompt), expected, strict=True
        ):
            got, final = decode.submit(request_id, prompt, GREEDY, healthy.endpoint()).result(
                WAIT_S
            )
            assert (got, final.finish_reason) == (want, "length")
        wait_until(lambda: decode_pool_full(decode, DECODE_PAGES), what="decode pool full again")
        state = healthy.state()
        assert (state["num_free_pages"], state["num_transfers"]) == (PREFILL_PAGES, 0)
    finally:
        dead.close(drain_timeout_s=1.0)
        healthy.close(drain_timeout_s=2.0)
