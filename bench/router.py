"""Router overhead and concurrency: ``python bench/router.py [--requests N] [--max-streams N]``.

Three processes (spawn), so that no two share a GIL:

- workers: ``--workers`` token services (`workers.service.server.WorkerServer`) over a
  synthetic backend that answers the first token at once and then one token per ``--itl``
  seconds to every running request, like a decode step; no model, so only the path is measured;
- router: `orchestrator.router.core.Router` + `GenerationServicer` over those workers (static
  registry), with the tiny preset's tokenizer (detokenization is part of the cost);
- this process: grpc.aio clients.

1. TTFT added by the router: the same request (16 prompt tokens) sent one at a time, alternately
   straight to a worker (``pdserve.v1.Worker/Generate``) and through the router
   (``pdserve.v1.Generation/Generate``); p50 / p99 of each and of the difference.
2. Concurrency scan: N simultaneous streams of ``--tokens`` tokens through the router, N up to
   ``--max-streams``; errors, TTFT p50 / p99, tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class SyntheticBackend:
    """First token at submit, then one token per ``itl`` to every request (a decode step)."""

    role = "decode"

    def __init__(self, itl: float) -> None:
        from workers.service.backend import Sink

        self._itl = itl
        self._lock = threading.Lock()
        self._running: dict[str, tuple[Sink, int]] = {}
        threading.Thread(target=self._steps, daemon=True).start()

    def submit(self, request_id, prompt_token_ids, params, prefill_endpoint, sink) -> None:  # type: ignore[no-untyped-def]
        from workers.wire import TokenDelta

        if params.max_tokens <= 1:
            sink(TokenDelta([65], None, True, "length"))
            return
        with self._lock:
            self._running[request_id] = (sink, params.max_tokens - 1)
        sink(TokenDelta([65]))

    def _steps(self) -> None:
        from workers.wire import TokenDelta

        while True:
            time.sleep(self._itl)
            with self._lock:
                running = list(self._running.items())
            for request_id, (sink, left) in running:
                done = left == 1
                sink(TokenDelta([66 + left % 20], None, done, "length" if done else None))
                with self._lock:
                    if done:
                        self._running.pop(request_id, None)
                    elif request_id in self._running:
                        self._running[request_id] = (sink, left - 1)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._running.pop(request_id, None)

    def load(self):  # type: ignore[no-untyped-def]
        from workers.wire import WorkerLoad

        return WorkerLoad(len(self._running), 0, 0, 0)

    def transfer_stats(self, request_id: str) -> None:
        return None

    def prefill_endpoint(self) -> bytes:
        return b""

    def close(self) -> None:
        pass


def workers_main(conn: Connection, num_workers: int, itl: float) -> None:
    from workers.service.server import WorkerServer, WorkerServicer

    servers = [
        WorkerServer(WorkerServicer(f"decode-{i}", SyntheticBackend(itl)))
        for i in range(num_workers)
    ]
    conn.send([s.address for s in servers])
    conn.recv()


def router_main(conn: Connection, addresses: list[str], model_dir: str) -> None:
    import os

    if os.environ.get("BENCH_PROFILE"):
        import cProfile

        cProfile.runctx(
            "asyncio.run(_router(conn, addresses, model_dir))",
            globals(),
            locals(),
            os.environ["BENCH_PROFILE"],
        )
    else:
        asyncio.run(_router(conn, addresses, model_dir))


async def _router(conn: Connection, addresses: list[str], model_dir: str) -> None:
    import grpc

    from orchestrator.api.servicer import GenerationServicer, GroupView
    from orchestrator.control.registry import Registry, WorkerRecord
    from orchestrator.router.core import Router
    from orchestrator.router.types import RouterSettings
    from protos.pdserve.v1 import generation_pb2 as pb
    from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
    from workers.engine.tokenizer import load_tokenizer

    registry = Registry()
    for i, address in enumerate(addresses):
        registry.add(WorkerRecord(f"decode-{i}", "decode", i, health="healthy", address=address))
    settings = RouterSettings(
        serving_role="decode",
        is_disaggregated=False,
        vocab_size=512,
        max_model_len=4096,
        pool_tokens=1 << 20,
        capacity_per_worker=4096,
        max_queue=4096,
        default_max_tokens=16,
    )
    router = Router(settings, registry, load_tokenizer(model_dir))
    servicer = GenerationServicer(
        router, pb.GetModelInfoResponse(), [GroupView("decode", "decode", 1, 1)]
    )
    server = grpc.aio.server(options=[("grpc.max_concurrent_streams", 4096)])
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    conn.send(f"127.0.0.1:{port}")
    await asyncio.get_running_loop().run_in_executor(None, conn.recv)
    await server.stop(1)


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def ttft_overhead(router: str, worker: str, num_requests: int) -> dict[str, float]:
    import grpc

    from protos.pdserve.v1 import generation_pb2 as pb
    from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
    from protos.pdserve.v1 import worker_pb2 as wpb
    from protos.pdserve.v1 import worker_pb2_grpc as wpb_grpc

    prompt = list(range(40, 56))
    direct_request = wpb.WorkerGenerateRequest(
        prompt_token_ids=prompt,
        sampling=wpb.WorkerSamplingParams(
            temperature=0, top_p=1, repetition_penalty=1, max_tokens=2
        ),
    )
    routed_request = pb.GenerateRequest(
        prompt_token_ids=prompt, sampling=pb.SamplingParams(temperature=0, max_tokens=2)
    )
    direct: list[float] = []
    routed: list[float] = []
    async with grpc.aio.insecure_channel(router) as rc, grpc.aio.insecure_channel(worker) as wc:
        router_stub, worker_stub = pb_grpc.GenerationStub(rc), wpb_grpc.WorkerStub(wc)
        for i in range(num_requests + 20):  # 20 warm-up rounds
            direct_request.request_id = f"d{i}"
            for stub, request, out in (
                (worker_stub, direct_request, direct),
                (router_stub, routed_request, routed),
            ):
                started = time.perf_counter()
                call = stub.Generate(request)
                async for _ in call:
                    if i >= 20:
                        out.append(time.perf_counter() - started)
                    break
                call.cancel()
                await asyncio.sleep(0.002)  # let the cancelled request's abort settle
    added = [r - d for r, d in zip(routed, direct, strict=True)]
    return {
        "direct_p50_ms": pct(direct, 0.5) * 1e3,
        "direct_p99_ms": pct(direct, 0.99) * 1e3,
        "router_p50_ms": pct(routed, 0.5) * 1e3,
        "router_p99_ms": pct(routed, 0.99) * 1e3,
        "added_p50_ms": (pct(routed, 0.5) - pct(direct, 0.5)) * 1e3,
        "added_p99_ms": (pct(routed, 0.99) - pct(direct, 0.99)) * 1e3,
        "paired_added_p50_ms": statistics.median(added) * 1e3,
    }


async def concurrency(router: str, num_streams: int, num_tokens: int) -> dict[str, float]:
    import grpc

    from protos.pdserve.v1 import generation_pb2 as pb
    from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc

    request = pb.GenerateRequest(
        prompt_token_ids=list(range(40, 56)),
        sampling=pb.SamplingParams(temperature=0, max_tokens=num_tokens),
    )
    ttfts: list[float] = []
    errors: list[str] = []
    tokens = 0

    async def one(stub: pb_grpc.GenerationStub) -> None:
        nonlocal tokens
        started = time.perf_counter()
        first = True
        try:
            async for response in stub.Generate(request, timeout=120):
                if first:
                    ttfts.append(time.perf_counter() - started)
                    first = False
                if response.finish_reason:
                    tokens += response.usage.completion_tokens
        except grpc.aio.AioRpcError as error:
            errors.append(error.code().name)

    # A few channels (HTTP/2 connections), as many clients would open.
    channels = [grpc.aio.insecure_channel(router) for _ in range(8)]
    stubs = [pb_grpc.GenerationStub(c) for c in channels]
    started = time.perf_counter()
    await asyncio.gather(*(one(stubs[i % len(stubs)]) for i in range(num_streams)))
    elapsed = time.perf_counter() - started
    for channel in channels:
        await channel.close()
    return {
        "streams": num_streams,
        "errors": len(errors),
        "ttft_p50_ms": pct(ttfts, 0.5) * 1e3 if ttfts else float("nan"),
        "ttft_p99_ms": pct(ttfts, 0.99) * 1e3 if ttfts else float("nan"),
        "tokens_per_s": tokens / elapsed,
        "seconds": elapsed,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--max-streams", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--itl", type=float, default=0.02)
    args = parser.parse_args(argv)

    from workers.engine.presets import write_random_checkpoint

    model_dir = write_random_checkpoint("tiny", tempfile.mkdtemp(prefix="bench-router-"))
    ctx = mp.get_context("spawn")
    workers_conn, workers_child = ctx.Pipe()
    workers = ctx.Process(target=workers_main, args=(workers_child, args.workers, args.itl))
    workers.start()
    addresses = workers_conn.recv()
    router_conn, router_child = ctx.Pipe()
    router = ctx.Process(target=router_main, args=(router_child, addresses, str(model_dir)))
    router.start()
    router_address = router_conn.recv()
    try:
        overhead = asyncio.run(ttft_overhead(router_address, addresses[0], args.requests))
        print(f"TTFT, {args.requests} sequential requests (16 prompt tokens):")
        for key, value in overhead.items():
            print(f"  {key:>22}: {value:7.3f}")
        print(
            f"\nconcurrency scan ({args.workers} synthetic workers, {args.tokens} tokens, "
            f"ITL {args.itl * 1e3:.0f} ms):"
        )
        print(
            f"  {'streams':>8} {'errors':>7} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} "
            f"{'tokens/s':>10} {'seconds':>8}"
        )
        scan = [n for n in (1, 10, 100, 250, 500, 1000) if n <= args.max_streams]
        for num_streams in scan:
            row = asyncio.run(concurrency(router_address, num_streams, args.tokens))
            print(
                f"  {row['streams']:>8} {row['errors']:>7} {row['ttft_p50_ms']:>12.2f} "
                f"{row['ttft_p99_ms']:>12.2f} {row['tokens_per_s']:>10.0f} "
                f"{row['seconds']:>8.2f}"
            )
    finally:
        for conn in (router_conn, workers_conn):
            conn.send("stop")
        router.join(10)
        workers.join(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
