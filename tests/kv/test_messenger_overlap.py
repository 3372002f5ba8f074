"""Layer-wise push: writes start while the forward pass is still running.

One 1500-token prompt in one prefill pass (budget 2048): the prefill worker records when it
submitted the first write (layer 0) and when the pass ended; the decoder records when the KV
was complete. Only the order of these timestamps is asserted (one host, one monotonic clock).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.engine.engine_helpers import prompts_of_lengths
from tests.kv.harness import RemotePrefill
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams
from workers.service.kv_worker import DecodeWorker

log = logging.getLogger(__name__)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("provider", ["tcp;ofi_rxm"])
def test_first_layer_is_sent_before_the_pass_ends(tiny_model_dir: Path, provider: str) -> None:
    prefill = RemotePrefill(
        tiny_model_dir, provider, engine={"num_pages": 128, "max_num_batched_tokens": 2048}
    )
    decode = DecodeWorker(tiny_model_dir, EngineConfig(num_pages=128), provider=provider)
    try:
        (prompt,) = prompts_of_lengths([1500], seed=5)
        params = SamplingParams(temperature=0.0, max_tokens=2)
        for attempt in range(2):  # the second run is warm (allocator, page faults)
            request_id = f"long{attempt}"
            tokens, final = decode.submit(request_id, prompt, params, prefill.endpoint).result(60)
            assert len(tokens) == 2, final.error
            sent = prefill.stats(request_id)
            ready = decode.transfer_stats(request_id)
            assert sent["state"] == "done" and ready is not None
            # requested -> first write (layer 0) -> pass ends -> context write -> KV complete
            assert ready["requested_s"] < sent["first_submit_s"] < sent["forward_end_s"]
            assert sent["forward_end_s"] < ready["kv_ready_s"]
            exposed = ready["kv_ready_s"] - sent["forward_end_s"]
            total = ready["kv_ready_s"] - ready["requested_s"]
            log.info("exposed transfer %.1f ms of %.1f ms", exposed * 1e3, total * 1e3)
    finally:
        decode.close()
        assert prefill.close() == 0
