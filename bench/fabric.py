"""Fabric benchmark: one-way write goodput and write-to-counter latency, with ceilings.

    .venv/bin/python bench/fabric.py [--providers tcp;ofi_rxm,shm] [--total-mib 384]

Goodput: a spawned target process arms one immediate counter for the whole point; the
initiator keeps `--inflight` writes in flight; the clock runs from the first submit to the
target's counter callback (both processes read CLOCK_MONOTONIC, shared on one host). Ceilings:
`iperf3` over loopback for tcp, a numpy copy of the same sizes for shm, and `fi_pingpong`
(two-sided messages) for reference. "paged" posts the same sizes as `submit_paged_writes` calls of 64 non-adjacent pages (the KV
path: one Python call per 64 writes, 4 calls in flight). Latency: one 4 KiB write at a time, submit -> the target's
counter callback, p50/p99.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.fabric import MemoryRegionDescriptor, TransferEngine

KIB = 1024
MIB = 1024 * KIB
SIZES = [16 * KIB, 64 * KIB, 256 * KIB, MIB]
REGION = 64 * MIB


def target(conn: Connection, provider: str) -> None:
    """Child: register REGION, then arm counters on request and report when they fire."""
    engine = TransferEngine(provider)
    buffer = np.zeros(REGION, dtype=np.uint8)
    _, descriptor = engine.register(buffer)
    conn.send_bytes(engine.address)
    conn.send_bytes(descriptor.to_bytes())
    lock = threading.Lock()

    def reached(imm: int) -> None:
        now = time.monotonic_ns()
        with lock:
            conn.send_bytes(json.dumps({"imm": imm, "t": now}).encode())

    while True:
        command = json.loads(conn.recv_bytes())
        if command["op"] == "close":
            break
        imm, count = command["imm"], command["count"]
        engine.expect_imm(imm, count, lambda imm=imm: reached(imm))
        with lock:
            conn.send_bytes(b'{"armed": true}')
    engine.close()


class Remote:
    def __init__(self, provider: str) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=target, args=(child, provider), daemon=True)
        self.process.start()
        self.address = self.conn.recv_bytes()
        self.descriptor = MemoryRegionDescriptor.from_bytes(self.conn.recv_bytes())

    def arm(self, imm: int, count: int) -> None:
        self.conn.send_bytes(json.dumps({"op": "arm", "imm": imm, "count": count}).encode())
        assert json.loads(self.conn.recv_bytes())["armed"]

    def reached_at(self) -> int:
        return int(json.loads(self.conn.recv_bytes())["t"])

    def close(self) -> None:
        self.conn.send_bytes(b'{"op": "close"}')
        self.process.join(30)


def goodput(
    engine: TransferEngine, remote: Remote, size: int, total: int, inflight: int, imm: int
) -> float:
    src = engine.register(np.ones(REGION, dtype=np.uint8))[0]
    peer = engine.add_peer(remote.address)
    count = total // size
    slots = threading.Semaphore(inflight)
    errors: list[BaseException] = []
    remote.arm(imm, count)
    offsets = [(i * size) % REGION for i in range(count)]
    start = time.monotonic_ns()
    for offset in offsets:
        slots.acquire()
        engine.submit_write(src, offset, peer, remote.descriptor, offset, size, imm=imm,
                            on_done=slots.release, on_error=errors.append)  # fmt: skip
    end = remote.reached_at()
    engine.deregister(src)
    if errors:
        raise errors[0]
    return count * size / ((end - start) / 1e9)


def paged_goodput(
    engine: TransferEngine, remote: Remote, size: int, total: int, imm: int, batch: int = 64
) -> float:
    """The KV path: one `submit_paged_writes` call posts `batch` non-adjacent pages."""
    src = engine.register(np.ones(REGION, dtype=np.uint8))[0]
    peer = engine.add_peer(remote.address)
    count, pages = total // size, REGION // size
    calls = threading.Semaphore(4)  # 4 calls x 64 ops in flight at most
    remote.arm(imm, count)
    start = time.monotonic_ns()
    for first in range(0, count, batch):
        # Descending page ids: no two pages coalesce, so every page is its own write.
        page_ids = (np.arange(first, min(first + batch, count)) % pages)[::-1].copy()
        calls.acquire()
        engine.submit_paged_writes(src, page_ids, peer, remote.descriptor, page_ids, size,
                                   imm=imm, on_done=calls.release)  # fmt: skip
    end = remote.reached_at()
    engine.deregister(src)
    return count * size / ((end - start) / 1e9)


def latency(engine: TransferEngine, remote: Remote, samples: int) -> tuple[float, float]:
    src = engine.register(np.ones(4 * KIB, dtype=np.uint8))[0]
    peer = engine.add_peer(remote.address)
    results = []
    for i in range(samples):
        remote.arm(1_000_000 + i, 1)
        start = time.monotonic_ns()
        engine.submit_write(src, 0, peer, remote.descriptor, 0, 4 * KIB, imm=1_000_000 + i)
        results.append((remote.reached_at() - start) / 1e3)
    engine.deregister(src)
    return float(np.percentile(results, 50)), float(np.percentile(results, 99))


def iperf3_ceiling(seconds: int = 3) -> tuple[float | None, str]:
    port = "5299"
    server = subprocess.Popen(
        ["iperf3", "-s", "-1", "-B", "127.0.0.1", "-p", port],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.5)
        out = subprocess.run(
            ["iperf3", "-c", "127.0.0.1", "-p", port, "-t", str(seconds), "-J"],
            capture_output=True,
            text=True,
            timeout=seconds + 20,
        )
        report = json.loads(out.stdout)
        return report["end"]["sum_received"]["bits_per_second"] / 8, "iperf3 -t 3 (1 stream)"
    except (OSError, ValueError, KeyError, subprocess.TimeoutExpired) as exc:
        return None, f"iperf3 failed: {exc}"
    finally:
        server.kill()
        server.wait()


def memcpy_bandwidth(size: int, total: int) -> float:
    src = np.ones(REGION, dtype=np.uint8)
    dst = np.zeros(REGION, dtype=np.uint8)
    count = total // size
    start = time.perf_counter()
    for i in range(count):
        offset = (i * size) % REGION
        np.copyto(dst[offset : offset + size], src[offset : offset + size])
    return count * size / (time.perf_counter() - start)


def fi_pingpong(provider: str, size: int = MIB, iterations: int = 200) -> str:
    args = ["fi_pingpong", "-p", provider, "-e", "rdm", "-S", str(size), "-I", str(iterations)]
    port = ["-B", "47592"] if provider != "shm" else []
    server = subprocess.Popen(
        [*args, *port], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        time.sleep(0.5)
        dst = ["-P", "47592", "127.0.0.1"] if provider != "shm" else ["localhost"]
        client = subprocess.run([*args, *dst], capture_output=True, text=True, timeout=30)
        server.communicate(timeout=10)
        if client.returncode != 0:
            tail = (client.stdout + client.stderr).strip()[-200:]
            return f"fi_pingpong failed (rc {client.returncode}): {tail}"
        lines = client.stdout.splitlines()
        header = next((i for i, line in enumerate(lines) if "MB/sec" in line), None)
        if header is None or header + 1 >= len(lines):
            return f"unparsed output: {client.stdout.strip()[-200:]}"
        columns = dict(zip(lines[header].split(), lines[header + 1].split(), strict=False))
        return f"{columns.get('MB/sec')} MB/s, {columns.get('usec/xfer')} us/xfer (two-sided)"
    except subprocess.TimeoutExpired:
        return "fi_pingpong timed out (30 s)"
    except OSError as exc:
        return f"fi_pingpong not runnable: {exc}"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--providers", default="tcp;ofi_rxm,shm")
    parser.add_argument("--total-mib", type=int, default=384)
    parser.add_argument("--inflight", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latency-samples", type=int, default=500)
    args = parser.parse_args()
    total = args.total_mib * MIB
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    print(f"machine: nproc={os.cpu_count()} cpu={cpu}")
    print(
        f"command: {' '.join(sys.argv)}  (total {args.total_mib} MiB/point, {args.inflight} in flight, median of {args.repeats})"
    )
    ceiling_tcp, how = iperf3_ceiling()
    print(f"tcp ceiling: {how}: {ceiling_tcp / 1e9:.2f} GB/s" if ceiling_tcp else how)
    rows = []
    for provider in args.providers.split(","):
        remote = Remote(provider)
        engine = TransferEngine(provider)
        try:
            for index, size in enumerate(SIZES):
                runs = [
                    goodput(engine, remote, size, total, args.inflight, index * 10 + r)
                    for r in range(args.repeats)
                ]
                ours = statistics.median(runs)
                if provider == "shm":
                    ceiling, name = (
                        statistics.median(memcpy_bandwidth(size, total) for _ in range(3)),
                        "memcpy",
                    )
                else:
                    ceiling, name = ceiling_tcp, "iperf3"
                paged = statistics.median(
                    paged_goodput(engine, remote, size, total, 500 + index * 10 + r)
                    for r in range(args.repeats)
                )
                rows.append((provider, size, ours, ceiling, name, paged))
            p50, p99 = latency(engine, remote, args.latency_samples)
            rows.append((provider, -1, p50, p99, "latency", 0.0))
        finally:
            engine.close()
            remote.close()
    print()
    print(
        f"{'provider':<13}{'size':>8}{'per-op GB/s':>13}{'ratio':>7}"
        f"{'paged GB/s':>12}{'ratio':>7}{'ceiling GB/s':>14}"
    )
    for provider, size, ours, ceiling, name, paged in rows:
        if name == "latency":
            print(
                f"{provider:<13}{'4 KiB':>8}  write->counter latency p50 {ours:.0f} us, p99 {ceiling:.0f} us"
            )
            continue
        ratio = f"{ours / ceiling:.2f}" if ceiling else "n/a"
        paged_ratio = f"{paged / ceiling:.2f}" if ceiling else "n/a"
        ceiling_text = f"{ceiling / 1e9:.2f} {name}" if ceiling else "n/a"
        print(
            f"{provider:<13}{size // KIB:>6}Ki{ours / 1e9:>13.2f}{ratio:>7}"
            f"{paged / 1e9:>12.2f}{paged_ratio:>7}{ceiling_text:>14}"
        )
    print()
    for provider in args.providers.split(","):
        print(f"fi_pingpong {provider} (1 MiB messages): {fi_pingpong(provider)}")


if __name__ == "__main__":
    main()
