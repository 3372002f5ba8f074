"""LayerProgress during real forward passes, observed from another thread."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from tests.engine.model_helpers import PagedRunner, random_tokens
from workers.engine.attention import AttentionBackend, AttentionBatch
from workers.engine.engine_core import create_layer_progress
from workers.engine.layer_progress import LayerProgress
from workers.engine.loader import load_model

WAIT_S = 30.0  # generous bound so a broken handshake fails instead of hanging


class HandshakeBackend(AttentionBackend):
    """Delegates to a real backend; before layer l's attention it waits until the reader thread
    has seen ``(pass_id, l)``, so every intermediate value is observed, with no timing games."""

    name = "handshake"

    def __init__(self, inner: AttentionBackend, progress: LayerProgress) -> None:
        super().__init__(inner.kv_cache, inner.page_size, inner.scale)
        self.inner = inner
        self.progress = progress
        self.seen_by_reader = [threading.Event() for _ in range(progress.num_layers)]
        self.read_inside: list[tuple[int, int]] = []

    def begin_step(self, batch: AttentionBatch) -> None:
        self.inner.begin_step(batch)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        self.read_inside.append(self.progress.read())
        assert self.seen_by_reader[layer].wait(WAIT_S), f"reader never saw layer {layer}"
        return self.inner.forward(layer, q, k, v, batch)


def test_reader_thread_sees_every_layer_of_a_forward_pass(tiny_model_dir: Path) -> None:
    model, config = load_model(tiny_model_dir)
    runner = PagedRunner(model, config)
    num_layers = config.num_layers
    progress = LayerProgress(num_layers)
    backend = HandshakeBackend(runner.backend, progress)
    runner.backend = backend
    observed: list[tuple[int, int]] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            pass_id, done = progress.read()
            if pass_id == 1 and (not observed or observed[-1] != (pass_id, done)):
                observed.append((pass_id, done))
                if done < num_layers:
                    backend.seen_by_reader[done].set()
                else:
                    return

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        runner.step([(0, random_tokens(10, seed=6)), (1, random_tokens(3, seed=7))], progress)
        assert progress.wait_for(1, num_layers, WAIT_S)
        thread.join(WAIT_S)
    finally:
        stop.set()
    assert not thread.is_alive()
    assert observed == [(1, layer) for layer in range(num_layers + 1)]
    # Inside layer l's attention, exactly the layers before it are marked done.
    assert backend.read_inside == [(1, layer) for layer in range(num_layers)]
    assert progress.read() == (1, num_layers)


def test_passes_are_numbered_and_reads_stay_consistent(tiny_model_dir: Path) -> None:
    model, config = load_model(tiny_model_dir)
    runner = PagedRunner(model, config)
    progress = create_layer_progress(config.num_layers, "cpu")
    assert progress.read() == (0, 0)
    samples: list[tuple[int, int]] = []
    stop = threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            samples.append(progress.read())
            time.sleep(0)  # let the forward thread have the GIL

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    try:
        tokens = random_tokens(8, seed=8)
        runner.step([(0, tokens)], progress)
        for token in tokens[:3]:
            runner.step([(0, [token])], progress)
    finally:
        stop.set()
        thread.join(WAIT_S)
    assert progress.read() == (4, config.num_layers)
    # Snapshots never go backwards: pass ids grow, and within a pass layers_done grows.
    assert samples == sorted(samples)
    assert all(0 <= done <= config.num_layers for _, done in samples)


def test_wait_for() -> None:
    progress = LayerProgress(3)
    assert not progress.wait_for(1, 1, timeout=0.01)
    assert progress.begin_pass() == 1
    progress.mark_layer_done(0)
    assert progress.wait_for(1, 1, timeout=0.01)
    assert not progress.wait_for(1, 2, timeout=0.01)
    progress.begin_pass()
    # A later pass means the earlier one finished.
    assert progress.wait_for(1, 3, timeout=0.01)
    assert progress.read() == (2, 0)
