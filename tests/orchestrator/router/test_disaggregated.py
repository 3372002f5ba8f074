"""The router in front of a real disaggregated pair, without Ray: a prefill worker and a decode
worker of the tiny preset, KV over libfabric ``tcp`` on loopback, compared with the mixed
worker's answers."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orchestrator.control.registry import Registry, WorkerRecord
from orchestrator.router.core import Router
from orchestrator.router.types import GenerationInput, RouterSettings, StreamEvent
from tests.orchestrator.harness import mixed_router
from workers.engine.config import EngineConfig
from workers.engine.tokenizer import load_tokenizer
from workers.service.backend import MixedBackend
from workers.service.server import WorkerServer, WorkerServicer


async def _events(router: Router, request: GenerationInput) -> list[StreamEvent]:
    stream: AsyncIterator[StreamEvent] = router.generate(request)
    return [event async for event in stream]


def test_disaggregated_serving_returns_the_logprobs_the_mixed_path_does(
    mixed_worker: tuple[MixedBackend, WorkerServer], tiny_model_dir: Path
) -> None:
    from tests.kv.harness import RemotePrefill
    from workers.service.kv_backends import DecodeBackend

    _, mixed_server = mixed_worker
    prefill = RemotePrefill(tiny_model_dir, "tcp;ofi_rxm", engine={"num_pages": 64})
    decode: DecodeBackend | None = None
    server: WorkerServer | None = None
    request = GenerationInput(
        "lp",
        "hello there",
        sampling={"temperature": 0.0},
        max_tokens=6,
        return_token_ids=True,
        return_logprobs=True,
    )

    async def run() -> tuple[list[StreamEvent], list[StreamEvent]]:
        assert server is not None
        tokenizer = load_tokenizer(tiny_model_dir)
        registry = Registry()
        registry.add(
            WorkerRecord("decode-0", "decode", 0, health="healthy", address=server.address)
        )
        registry.add(
            WorkerRecord(
                "prefill-0",
                "prefill",
                0,
                health="healthy",
                prefill_endpoint=prefill.endpoint.to_bytes(),
            )
        )
        settings = RouterSettings("decode", True, tokenizer.vocab_size, 512, 64 * 16, 4, 4, 8)
        router = Router(settings, registry, tokenizer)
        baseline = mixed_router(tiny_model_dir, mixed_server.address)
        try:
            return await _events(router, request), await _events(baseline, request)
        finally:
            await router.close()
            await baseline.close()

    try:
        decode = DecodeBackend(
            tiny_model_dir, EngineConfig(role="decode", num_pages=64), "tcp;ofi_rxm", None, {}
        )
        server = WorkerServer(WorkerServicer("decode-0", decode))
        disaggregated, colocated = asyncio.run(run())
        # The KV came over the fabric; its record is found by the client's id.
        assert (decode.transfer_stats("lp") or {}).get("state") is not None
    finally:
        if server is not None:
            server.stop(0.1)
        if decode is not None:
            decode.close()
        prefill.close()
    ids = [t for event in disaggregated for t in event.token_ids]
    logprobs = [v for event in disaggregated for v in event.logprobs]
    assert len(ids) == len(logprobs) == 6
    assert all(math.isfinite(v) and v <= 0.0 for v in logprobs)
    assert ids == [t for event in colocated for t in event.token_ids]
    expected = [v for event in colocated for v in event.logprobs]
    assert logprobs == pytest.approx(expected, abs=1e-3)
