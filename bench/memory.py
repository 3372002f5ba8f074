"""Memory of an engine, or of a cluster's workers, as they serve prompts of many lengths.

    python bench/memory.py engine --model DIR [--prompts 400] [--prompt uniform:1500-1900]
        [--every 50] [--max-num-batched-tokens 2048] [--json OUT]
    python bench/memory.py padding [--rows 1700-1731] [--json OUT]
    RAY_AUTH_MODE=disabled python bench/memory.py cluster CONFIG [--model DIR] --rates 2.5,3
        [--seeds 0,1,2] [--prompt uniform:1500-1900 --output uniform:32-64 ...] [--json OUT]

``engine``: one engine in this process prefills prompts of random ids and lengths from
``--prompt`` (one token out each), and every ``--every`` prompts prints its RSS and what
glibc's malloc holds in use and free: whether memory grows with the prompts seen, whether it
is held (in use) or lost to fragmentation (free), and whether it levels off.

``padding``: what that costs: a layer's projections on rows padded to `cpu_gemm.row_bucket`
against the same GEMMs on the exact rows, alternated (the machine's drift cancels).

``cluster``: one cluster for the runs of a sweep (each rate and seed in turn, as `pdserve bench
sweep` runs one side, same workload flags), and after each run every worker process's RSS,
CPU priority (``nice``: a prefill group's is often 10) and CPU seconds, read from ``/proc``.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WORKER_TITLE = "ray::WorkerActor"  # a worker process's title, as Ray sets it


def _mallinfo() -> Any:
    """glibc's ``mallinfo2`` (2.33+), or None."""
    try:
        function = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    names = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks")

    class Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (*names, "fordblks", "keepcost")]

    function.restype = Info
    return function


def process_memory(pid: int) -> dict[str, Any] | None:
    """RSS (MiB), nice and CPU seconds of ``pid``, or None when it is gone."""
    proc = Path("/proc") / str(pid)
    try:
        stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        status = (proc / "status").read_text()
    except OSError:
        return None
    rss_kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
    ticks = int(stat[11]) + int(stat[12])  # utime + stime (fields 14, 15)
    return {
        "pid": pid,
        "rss_mb": round(rss_kib / 1024, 1),
        "nice": int(stat[16]),  # field 19
        "cpu_s": round(ticks / os.sysconf("SC_CLK_TCK"), 1),
    }


def worker_memory() -> list[dict[str, Any]]:
    """`process_memory` of every pdserve worker process on this host, by nice then pid."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if title.startswith(WORKER_TITLE) and (memory := process_memory(int(entry.name))):
            found.append(memory)
    return sorted(found, key=lambda m: (m["nice"], m["pid"]))


def run_engine(args: argparse.Namespace) -> list[dict[str, Any]]:
    from orchestrator.sim.workload import LengthDist
    from workers.engine import LLM, SamplingParams

    lengths = LengthDist.parse(args.prompt)
    llm = LLM(
        args.model,
        detokenize=False,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=32,
        max_model_len=max(args.max_num_batched_tokens, lengths.high + 1),
    )
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    mallinfo, rng, rows = _mallinfo(), random.Random(args.seed), []
    start = time.monotonic()

    def row(prompts: int) -> dict[str, Any]:
        memory = process_memory(os.getpid()) or {}
        found: dict[str, Any] = {"prompts": prompts, "seconds": round(time.monotonic() - start, 1)}
        found["rss_mb"] = memory.get("rss_mb")
        if mallinfo is not None:
            info = mallinfo()
            found["in_use_mb"] = round(info.uordblks / 2**20, 1)
            found["free_mb"] = round(info.fordblks / 2**20, 1)
        print(" ".join(f"{k} {v}" for k, v in found.items()), flush=True)
        return found

    rows.append(row(0))
    for done in range(1, args.prompts + 1):
        length = rng.randint(lengths.low, lengths.high)
        llm.generate([[rng.randrange(vocab) for _ in range(length)]], params)
        if done % args.every == 0 or done == args.prompts:
            rows.append(row(done))
    llm.close()
    return rows


def run_padding(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The price of bounded memory: a layer's four projections (the ``small`` preset's shapes
    unless given) over each row count of ``--rows``, through `cpu_gemm.linear` (padded to a
    bucket) and through oneDNN on the exact rows, alternated; medians over the row counts."""
    import statistics

    import torch

    from workers.engine import cpu_gemm

    cpu_gemm.MAX_EXACT_COUNTS = 0  # every count padded, however few were met before
    hidden, kv, inter = args.hidden, args.kv_width, args.intermediate
    shapes = [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    weights = [cpu_gemm.pack(torch.randn(out, into)) for out, into in shapes]

    def exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    low, _, high = args.rows.partition("-")
    times: dict[str, list[float]] = {"exact": [], "padded": []}
    with torch.inference_mode():
        for rows in range(int(low), int(high or low) + 1):
            xs = [torch.randn(rows, into) for _, into in shapes]
            for name in ("exact", "padded", "exact", "padded"):
                run = exact if name == "exact" else cpu_gemm.linear
                for w, x in zip(weights, xs, strict=True):  # this shape's kernel built first
                    run(x, w)
                start = time.perf_counter()
                for _ in range(args.repeats):
                    for w, x in zip(weights, xs, strict=True):
                        run(x, w)
                times[name].append((time.perf_counter() - start) / args.repeats * 1e3)
    found = {name: round(statistics.median(ms), 3) for name, ms in times.items()}
    ratio = found["padded"] / found["exact"]
    print(f"rows {args.rows}: a layer's projections {found['exact']} ms exact, "
          f"{found['padded']} ms padded to buckets ({ratio:.3f}x)")  # fmt: skip
    return [{"rows": args.rows, "ms": found, "ratio": round(ratio, 4)}]


def run_cluster(args: argparse.Namespace) -> list[dict[str, Any]]:
    from orchestrator.loadgen import commands
    from orchestrator.loadgen.compare import load_config
    from orchestrator.loadgen.sweep import sweep_cluster
    from orchestrator.loadgen.sweep_command import build_plan

    args.bisect, args.plot, args.num_cpus, args.backend = 0, None, None, "grpc"
    plan = build_plan(args, commands._options)
    config = load_config(args.config, args.model)
    rows: list[dict[str, Any]] = []

    def on_run(run: Any) -> None:
        workers = worker_memory()
        attainment = run.metrics["slo_attainment"]
        rows.append(
            {"rate": run.rate, "seed": run.seed, "attainment": attainment, "workers": workers}
        )
        cells = " | ".join(f"nice {w['nice']} {w['rss_mb']:.0f} MB {w['cpu_s']} s" for w in workers)
        print(
            f"rate {run.rate:g} seed {run.seed}: attainment {attainment:.3f} | {cells}", flush=True
        )

    asyncio.run(sweep_cluster("cluster", config, plan, on_run=on_run))
    return rows


def main(argv: list[str] | None = None) -> int:
    from orchestrator.loadgen import commands

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    engine = sub.add_parser("engine", help="one engine in this process")
    engine.add_argument("--model", required=True)
    engine.add_argument("--prompts", type=int, default=400)
    engine.add_argument("--prompt", default="uniform:1500-1900", help="uniform:A-B or fixed:N")
    engine.add_argument("--every", type=int, default=50, help="print every N prompts")
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument("--seed", type=int, default=0)
    padding = sub.add_parser("padding", help="projections on padded rows against exact ones")
    padding.add_argument("--rows", default="1700-1731", help="N or A-B: the row counts")
    padding.add_argument("--hidden", type=int, default=512)
    padding.add_argument("--kv-width", type=int, default=256, help="KV heads x head size")
    padding.add_argument("--intermediate", type=int, default=1376)
    padding.add_argument("--repeats", type=int, default=5)
    cluster = sub.add_parser("cluster", help="a cluster's workers over a sweep's runs")
    cluster.add_argument("config")
    cluster.add_argument("--model", default=None, help="the model directory (default: config's)")
    cluster.add_argument("--rates", required=True)
    cluster.add_argument("--seeds", default="0,1,2")
    commands._add_workload_arguments(cluster, sweep=True)
    for p in (engine, padding, cluster):
        p.add_argument("--json", default=None, help="write every row here")
    args = parser.parse_args(argv)
    runs = {"engine": run_engine, "padding": run_padding, "cluster": run_cluster}
    rows = runs[args.mode](args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
