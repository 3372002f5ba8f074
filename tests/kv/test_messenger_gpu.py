"""Disaggregated serving with both KV pools in GPU memory (needs CUDA; skips without it).

The prefill worker (a spawned process) and the decode worker open their transfer engines with
FI_HMEM (`workers.service.kv_worker.open_fabric`) and register their CUDA pools; shm moves the pages
GPU to GPU (CUDA IPC). Greedy output must match the colocated engine on the same GPU, and both
pools must be full again. A libfabric built without CUDA refuses the registration with a typed
error, and the test skips saying so.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.engine_helpers import make_engine, prompts_of_lengths, run_engine
from tests.kv.harness import RemotePrefill
from tests.waiting import wait_until
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams
from workers.fabric import RegistrationError
from workers.service.kv_worker import DecodeWorker

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def test_cuda_pools_disaggregated_parity(tiny_model_dir: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    prompts = prompts_of_lengths([2, 16, 17, 200], seed=5)
    colocated = run_engine(make_engine(tiny_model_dir, device="cuda"), prompts, GREEDY)
    try:
        decode = DecodeWorker(
            tiny_model_dir, EngineConfig(num_pages=120, device="cuda"), provider="shm"
        )
    except RegistrationError as error:
        pytest.skip(f"this libfabric cannot register CUDA memory: {error}")
    prefill = RemotePrefill(
        tiny_model_dir,
        "shm",
        engine={"num_pages": 96, "max_num_batched_tokens": 64, "device": "cuda"},
    )
    try:
        streams = [
            decode.submit(f"g{i}", prompt, GREEDY, prefill.endpoint)
            for i, prompt in enumerate(prompts)
        ]
        results = [stream.result(120) for stream in streams]
        assert [final.error for _, final in results] == [None] * len(prompts)
        assert [tokens for tokens, _ in results] == colocated
        wait_until(lambda: decode.state()["num_free_pages"] == 120, what="decode pool full")
        wait_until(lambda: prefill.state()["num_free_pages"] == 96, what="prefill pool full")
    finally:
        decode.close()
        assert prefill.close() == 0
