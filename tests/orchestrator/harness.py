"""Routers over real worker servers on loopback, for the router and API tests without Ray.

The workers are real `WorkerServer`s; their backends are the fakes of `tests.fakes` (tokens when
a test says) or a real `MixedBackend` running the tiny preset (`mixed_router`). The fixtures
that start them are in ``tests/orchestrator/conftest.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from pathlib import Path

from orchestrator.control.registry import Registry, WorkerRecord
from orchestrator.router.core import Router
from orchestrator.router.types import GenerationInput, RouterSettings, StreamEvent
from tests.fakes import FakeBackend
from tests.waiting import wait_until
from workers.engine.tokenizer import ByteTokenizer, load_tokenizer
from workers.metrics import Metrics
from workers.service.backend import MixedBackend
from workers.service.server import WorkerServer, WorkerServicer

# Bounds the waits for what a bug prevents (a test fails then, rather than hangs).
BUG_BOUND = 10.0
# The engine of `mixed_router`'s worker (the ``mixed_worker`` fixture).
MAX_MODEL_LEN = 512
NUM_PAGES = 128
GREEDY = {"temperature": 0.0, "ignore_eos": True}


class Servers:
    """Worker servers of one test, stopped at its end unless the test stopped them."""

    def __init__(self) -> None:
        self.running: list[WorkerServer] = []

    def start(self, backend: FakeBackend, worker_id: str) -> str:
        server = WorkerServer(WorkerServicer(worker_id, backend))
        self.running.append(server)
        return server.address

    def stop(self, address: str) -> None:
        """As when the worker's process dies: its streams break."""
        server = next(s for s in self.running if s.address == address)
        self.running.remove(server)
        server.stop(0)


def record(worker_id: str, address: str = "") -> WorkerRecord:
    """A healthy decode worker."""
    return WorkerRecord(worker_id, "decode", 0, health="healthy", address=address)


def decode_router(address: str, capacity: int = 4, max_queue: int = 1) -> Router:
    """A router of one decode worker, ``decode-0`` (byte tokenizer, max_model_len 64)."""
    registry = Registry()
    registry.add(record("decode-0", address))
    settings = RouterSettings(
        serving_role="decode",
        is_disaggregated=False,
        vocab_size=512,
        max_model_len=64,
        pool_tokens=1024,
        capacity_per_worker=capacity,
        max_queue=max_queue,
        default_max_tokens=8,
    )
    return Router(settings, registry, ByteTokenizer())


def round_robin_router(
    addresses: list[str], worker_retries: int = 1, metrics: Metrics | None = None
) -> Router:
    """A router of decode workers ``decode-<i>`` at ``addresses``, chosen in turn from
    ``decode-0``."""
    registry = Registry()
    for i, address in enumerate(addresses):
        registry.add(WorkerRecord(f"decode-{i}", "decode", i, health="healthy", address=address))
    settings = RouterSettings(
        serving_role="decode",
        is_disaggregated=False,
        vocab_size=512,
        max_model_len=64,
        pool_tokens=1024,
        capacity_per_worker=4,
        max_queue=4,
        default_max_tokens=8,
        policy="round_robin",  # decode-0 first
        worker_retries=worker_retries,
    )
    return Router(settings, registry, ByteTokenizer(), metrics)


def disaggregated_router(
    address: str,
    prefill: dict[str, bytes],
    retries: int,
    metrics: Metrics | None = None,
    local_fallback: bool = False,
) -> Router:
    """A router of decoder ``decode-0`` and the prefill workers ``prefill`` (id -> endpoint)."""
    registry = Registry()
    registry.add(record("decode-0", address))
    for i, (worker_id, endpoint) in enumerate(prefill.items()):
        registry.add(
            WorkerRecord(worker_id, "prefill", i, health="healthy", prefill_endpoint=endpoint)
        )
    settings = RouterSettings(
        serving_role="decode",
        is_disaggregated=True,
        vocab_size=512,
        max_model_len=64,
        pool_tokens=1024,
        capacity_per_worker=4,
        max_queue=1,
        default_max_tokens=8,
        prefill_retries=retries,
        local_prefill_fallback=local_fallback,
        seed=0,
    )
    return Router(settings, registry, ByteTokenizer(), metrics)


def mixed_router(
    model_dir: Path, address: str, *, capacity: int = 8, metrics: Metrics | None = None
) -> Router:
    """A router of the real mixed worker ``mixed-0`` at ``address`` (the model's tokenizer)."""
    tokenizer = load_tokenizer(model_dir)
    registry = Registry()
    registry.add(WorkerRecord("mixed-0", "mixed", 0, health="healthy", address=address))
    settings = RouterSettings(
        serving_role="mixed",
        is_disaggregated=False,
        vocab_size=tokenizer.vocab_size,
        max_model_len=MAX_MODEL_LEN,
        pool_tokens=NUM_PAGES * 16,
        capacity_per_worker=capacity,
        max_queue=8,
        default_max_tokens=16,
        eos_token_ids=frozenset(tokenizer.eos_token_ids),
    )
    return Router(settings, registry, tokenizer, metrics)


async def next_event(stream: AsyncGenerator[StreamEvent, None]) -> StreamEvent:
    """The stream's next event (a coroutine, for `asyncio.create_task`)."""
    return await anext(stream)


async def collect(router: Router, request_id: str) -> list[StreamEvent]:
    """Every event of a request, until its stream ends (its slot then released)."""
    return [event async for event in router.generate(GenerationInput(request_id, "x"))]


async def engine_idle(backend: MixedBackend) -> None:
    """Wait until the engine runs and queues nothing (read off the event loop's thread: each
    look waits for the engine's step)."""

    def idle() -> bool:
        load = backend.load()
        return load.num_running_requests == load.num_waiting_requests == 0

    await asyncio.get_running_loop().run_in_executor(
        None, wait_until, idle, 60.0, "the engine idle"
    )
