"""KV messenger benchmark: transfer goodput vs the raw TransferEngine, and exposed transfer time.

    .venv/bin/python bench/transfer.py [--provider tcp;ofi_rxm] [--lengths 256,...,8192]
                                       [--repeats 3] [--checksum] [--preset deepseek-tiny]

``--checksum`` runs the decoder in checksum mode (`workers.kv.checksum`: CRC-32 of every write
on the prefill's push thread, verified on the decoder when its counter fires) to measure its
cost against a run without.

Setup: preset ``small`` (hidden 512, 6 layers, 4 KV heads of 64, float32; its config is
widened to 8704 positions so an 8192-token prompt fits), or with ``--preset deepseek-tiny`` a
DeepSeek-V3-style model (3 layers, MLA: one latent of 80 values a token and layer, MoE), page
size 16, one prefill worker in a
spawned process (budget 8192 tokens: every prompt is one forward pass), one decode worker in
this process, both on one host (one CLOCK_MONOTONIC). Per prompt length, median of
``--repeats`` requests (after a warm-up) in each of two prefill modes:

- **layer-wise** (the design): each layer's writes are submitted as soon as the layer is done;
- **deferred** (baseline): the same writes, submitted only once the forward pass ended.

Figures:
- ``exposed`` = decoder KV-ready time - prefill forward-pass end, per mode.
- ``exposed fraction`` = exposed(layer-wise) / exposed(deferred): the share of the transfer
  the forward pass could not hide. Target <= 1/L + 5% (L = 6 layers: 0.217; 3: 0.383).
- ``messenger GB/s`` = KV bytes / exposed(deferred): with deferred writes the whole transfer
  happens after the pass, messaging, counter and wake-ups included.
- ``raw GB/s``: the same number of writes of the same sizes (one `submit_writes` call per
  layer, like the messenger) from this process's TransferEngine to a spawned target's, first
  submit -> the target's immediate counter fired, measured right after each deferred-mode
  request (same load). Target: messenger >= 0.9x raw. The raw target's region is filled once
  before use, like the decoder's `torch.zeros` KV pool: a lazily mapped `np.zeros` took its page
  faults inside the first raw measurement of every new, larger prompt length.
- ``ratio`` = the median over the requests of messenger GB/s / raw GB/s, each request against
  the raw measurement taken right after it (so the ratio is not that of the two medians).

On shm the raw path and the messenger now read from the same kind of memory. shm copies with
CMA (the target's kernel reads the initiator's pages) at ~0.75x the rate from 4 KiB pages that
it reaches from the 2 MiB transparent huge pages numpy gives the raw source, and the
messenger's source is the prefill's torch KV pool (4 KiB pages). `TransferEngine.register` now
moves shm regions to huge pages (workers/fabric/engine.py), so both sources are huge-paged.
The roles stay swapped between the two (messenger: the decoder in this process is the target
whose progress thread does the copies; raw: a bare spawned target does them); that difference
is not isolated (bench/history/RESULTS-notebook.md, "Transfer: the shm gap").

OpenMP workers of the prefill process's torch spin for a while after every parallel region
(``OMP_WAIT_POLICY`` active by default) and then compete with both fabric progress threads for
the two cores; the benchmark sets ``OMP_WAIT_POLICY=PASSIVE`` unless told otherwise (a CPU-only
artefact: GPU prefill leaves the cores to the fabric).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.engine.config import EngineConfig
from workers.engine.model_config import ModelConfig
from workers.engine.presets import write_random_checkpoint
from workers.engine.sampling_params import SamplingParams
from workers.fabric import MemoryRegionDescriptor, TransferEngine
from workers.kv.checksum import area_bytes
from workers.kv.decode_messenger import DecodeMessengerConfig
from workers.kv.endpoint import PrefillEndpoint
from workers.service.kv_worker import DecodeWorker
from workers.service.prefill_process import prefill_process_main

SPAWN = multiprocessing.get_context("spawn")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # inherited by the spawned prefill worker
MAX_POSITIONS = 8704
NUM_PAGES = 600
RAW_REGION = 128 << 20
PRESETS = ("small", "deepseek-tiny")


def widened_checkpoint(root: Path, preset: str) -> Path:
    model_dir = write_random_checkpoint(preset, root / preset)
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = MAX_POSITIONS
    config_path.write_text(json.dumps(config, indent=2))
    return model_dir


class Prefill:
    def __init__(self, model_dir: Path, provider: str, layerwise: bool) -> None:
        options = {
            "model_dir": str(model_dir),
            "provider": provider,
            "engine": {"num_pages": NUM_PAGES, "max_num_batched_tokens": 8192},
            "messenger": {"layerwise": layerwise},
        }
        self.conn, child = SPAWN.Pipe()
        self.process = SPAWN.Process(
            target=prefill_process_main, args=(child, json.dumps(options).encode()), daemon=True
        )
        self.process.start()
        child.close()
        self.endpoint = PrefillEndpoint.from_bytes(self.conn.recv_bytes())

    def stats(self, request_id: str) -> dict[str, Any]:
        self.conn.send_bytes(json.dumps({"op": "stats", "request_id": request_id}).encode())
        stats: dict[str, Any] = json.loads(self.conn.recv_bytes())
        return stats

    def close(self) -> None:
        self.conn.send_bytes(b'{"op": "close"}')
        self.process.join(30)


def run_messenger(
    model_dir: Path,
    provider: str,
    lengths: list[int],
    repeats: int,
    layerwise: bool,
    raw: RawBench | None = None,
    checksum: bool = False,
) -> dict[int, dict[str, float]]:
    """Median figures per prompt length; with ``raw``, each request is followed by a raw
    measurement of the same writes (same sizes, one call per layer), so both see the same
    machine load."""
    model = ModelConfig.from_dir(model_dir)
    layers = model.num_layers
    prefill = Prefill(model_dir, provider, layerwise)
    decode = DecodeWorker(
        model_dir,
        EngineConfig(num_pages=NUM_PAGES),
        provider=provider,
        messenger_config=DecodeMessengerConfig(checksum=checksum),
    )
    # The context write's bytes: the hidden state, and the sums of TP 1:1's one shard.
    context_bytes = model.hidden_size * 4 + (area_bytes(1) if checksum else 0)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    results: dict[int, dict[str, float]] = {}
    try:
        for length in lengths:
            runs = []
            for attempt in range(repeats + 1):
                request_id = f"{length}-{attempt}"
                prompt = rng.integers(0, 256, length).tolist()
                _, final = decode.submit(request_id, prompt, params, prefill.endpoint).result(300)
                assert final.error is None, final.error
                sent, ready = prefill.stats(request_id), decode.transfer_stats(request_id)
                deadline = time.monotonic() + 30
                while sent is None and time.monotonic() < deadline:
                    # The decoder may be done before the prefill saw its last local completion.
                    time.sleep(0.01)
                    sent = prefill.stats(request_id)
                assert ready is not None and sent["state"] == "done"
                if attempt == 0:
                    continue  # warm-up
                raw_gbps = 0.0
                if raw is not None:
                    num_kv_writes = sent["num_writes"] - 1  # minus the context write
                    per_layer = num_kv_writes // layers
                    kv_bytes = sent["num_bytes"] - context_bytes
                    # The request's runs: equal split is exact for 1 run per layer, close else.
                    size = kv_bytes // num_kv_writes
                    raw_gbps = raw.measure(layers, [size] * per_layer)
                exposed_s = ready["kv_ready_s"] - sent["forward_end_s"]
                # This request's goodput over the raw path's right after it: paired, so that
                # a drift of the machine during the run moves both sides alike.
                goodput = sent["num_bytes"] / exposed_s / 1e9
                runs.append(
                    {
                        "raw_gbps": raw_gbps,
                        "ratio": goodput / raw_gbps if raw is not None else 0.0,
                        "bytes": sent["num_bytes"],
                        "writes": sent["num_writes"],
                        "forward_s": sent["forward_end_s"] - sent["prefill_start_s"],
                        "exposed_s": exposed_s,
                        "first_write_before_end_s": sent["forward_end_s"] - sent["first_submit_s"],
                        "total_s": ready["kv_ready_s"] - ready["requested_s"],
                    }
                )
            results[length] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    finally:
        decode.close()
        prefill.close()
    return results


def raw_target(conn: Connection, provider: str) -> None:
    engine = TransferEngine(provider)
    buffer = np.empty(RAW_REGION, dtype=np.uint8)
    buffer.fill(0)  # faulted in now, like the decoder's torch.zeros pool (docstring)
    _, descriptor = engine.register(buffer)
    conn.send_bytes(engine.address)
    conn.send_bytes(descriptor.to_bytes())
    lock = threading.Lock()

    def reached() -> None:
        now = time.monotonic()
        with lock:
            conn.send_bytes(json.dumps({"t": now}).encode())

    while True:
        command = json.loads(conn.recv_bytes())
        if command.get("op") == "close":
            break
        engine.expect_imm(command["imm"], command["count"], reached)
        with lock:
            conn.send_bytes(b'{"armed": true}')
    engine.close()


class RawBench:
    """The raw TransferEngine path: this process's engine writes to a spawned target's."""

    def __init__(self, provider: str) -> None:
        self.conn, child = SPAWN.Pipe()
        self.process = SPAWN.Process(target=raw_target, args=(child, provider), daemon=True)
        self.process.start()
        address = self.conn.recv_bytes()
        self.descriptor = MemoryRegionDescriptor.from_bytes(self.conn.recv_bytes())
        self.engine = TransferEngine(provider)
        self.source = np.ones(RAW_REGION, dtype=np.uint8)
        self.handle, _ = self.engine.register(self.source)
        self.peer = self.engine.add_peer(address)
        self.imm = 1

    def measure(self, layers: int, sizes: list[int]) -> float:
        """GB/s of one call per layer posting writes of ``sizes`` bytes; first submit -> the
        target's counter fired."""
        offsets = np.cumsum([0, *sizes[:-1]], dtype=np.int64)
        rows = np.stack([offsets, offsets, np.asarray(sizes, dtype=np.int64)], axis=1)
        self.conn.send_bytes(json.dumps({"imm": self.imm, "count": len(sizes) * layers}).encode())
        assert json.loads(self.conn.recv_bytes())["armed"]
        start = time.monotonic()
        for layer in range(layers):
            layer_bytes = layer * int(sum(sizes))
            shifted = rows + np.array([layer_bytes, layer_bytes, 0], dtype=np.int64)
            self.engine.submit_writes(
                self.handle, self.peer, self.descriptor, shifted, imm=self.imm
            )
        end = json.loads(self.conn.recv_bytes())["t"]
        self.imm += 1
        return layers * sum(sizes) / (end - start) / 1e9

    def close(self) -> None:
        self.conn.send_bytes(b'{"op": "close"}')
        self.process.join(30)
        self.engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--provider", default="tcp;ofi_rxm")
    parser.add_argument("--lengths", default="256,512,1024,2048,4096,8192")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--checksum", action="store_true", help="decoder in checksum mode")
    parser.add_argument("--preset", choices=PRESETS, default="small", help="model (random init)")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    raw = RawBench(args.provider)
    try:
        with tempfile.TemporaryDirectory() as root:
            model_dir = widened_checkpoint(Path(root), args.preset)
            model = ModelConfig.from_dir(model_dir)
            layerwise = run_messenger(
                model_dir, args.provider, lengths, args.repeats, True, checksum=args.checksum
            )
            deferred = run_messenger(
                model_dir, args.provider, lengths, args.repeats, False, raw, args.checksum
            )
    finally:
        raw.close()
    mode = ", checksum mode" if args.checksum else ""
    print(f"# provider {args.provider}{mode}, {os.cpu_count()} CPUs, {platform.processor() or '?'}")
    kv_per_token = model.kv_page_bytes(1, 4)
    print(f"# preset {args.preset}: {model.num_layers} layers, {kv_per_token} KV bytes a token")
    print(
        "| prompt | KV MiB | writes | forward ms | exposed ms (layer-wise) | exposed ms (deferred) "
        "| exposed fraction | messenger GB/s | raw GB/s | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in lengths:
        lw, df = layerwise[n], deferred[n]
        fraction = lw["exposed_s"] / df["exposed_s"]
        goodput = df["bytes"] / df["exposed_s"] / 1e9
        print(
            f"| {n} | {df['bytes'] / 2**20:.1f} | {int(df['writes'])} | {lw['forward_s'] * 1e3:.0f} "
            f"| {lw['exposed_s'] * 1e3:.1f} | {df['exposed_s'] * 1e3:.1f} | {fraction:.2f} "
            f"| {goodput:.2f} | {df['raw_gbps']:.2f} | {df['ratio']:.2f} |"
        )
    print(f"target: exposed fraction <= {1 / model.num_layers + 0.05:.3f}; messenger >= 0.9x raw")


if __name__ == "__main__":
    main()
