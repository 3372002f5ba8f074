"""Serving benchmark: ``pdserve serve`` against ``vllm serve`` under Poisson load, one client.

    python bench/serving.py [--configs configs/bench-serve-mixed.yaml,configs/local-1p3d.yaml]
        [--rates 0.3,0.6,1.0,4] [--seeds 3,4,5] [--workloads random-256-64,chat]
        [--num-prompts 40] [--json bench/out/serving.json]

Every server serves the same checkpoint (the configs' model; vLLM in float32) on this machine,
alone; vLLM's own benchmark client (``vllm bench serve``, random dataset, ``--ignore-eos``,
greedy) drives each over its OpenAI ``/v1/completions`` endpoint, so the figures are what a user
of either would measure. A seed's runs at its several rates send different prompts (the
client's seed is the seed + 1000 x the rate's position): both servers cache prefixes, and a
repeated prompt list would be served from the cache. Needs vLLM's venv: ``make bench-peers``.
How the runs are ordered and summarised: `peers.compare_serving`. Progress goes to stderr; the
table to stdout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peers.compare_serving import (
    ROOT,
    WORKLOADS,
    Server,
    client_command,
    client_seed,
    format_rows,
    keep,
    medians,
    pdserve_server,
    running,
    save,
    server_order,
    verdicts,
    vllm_server,
)
from peers.process_cpu import TreeSampler, format_cores
from peers.vllm_peer import PeerUnavailable, vllm_engine_python, vllm_python

from orchestrator.config.cluster import ClusterConfig

PORT = 8400  # HTTP port of the server under test (its gRPC port: the next one)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configs",
        default="configs/bench-serve-mixed.yaml,configs/local-1p3d.yaml",
        help="pdserve cluster configs, comma separated (each is one server)",
    )
    parser.add_argument("--no-vllm", action="store_true", help="measure our servers only")
    parser.add_argument("--rates", default="0.3,0.6,1.0,4", help="offered req/s (Poisson)")
    parser.add_argument("--seeds", default="3,4,5")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"of {list(WORKLOADS)}")
    parser.add_argument("--num-prompts", type=int, default=40, help="requests per run")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "serving.json")
    parser.add_argument(
        "--merge",
        type=Path,
        action="append",
        default=[],
        help="add the runs of an earlier --json to the table (e.g. vLLM's, measured once)",
    )
    parser.add_argument("--logs", type=Path, default=ROOT / ".cache" / "bench-serving")
    args = parser.parse_args()

    rates = [float(r) for r in args.rates.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    try:
        workloads = [WORKLOADS[w] for w in args.workloads.split(",")]
        # The client (vLLM's) runs anywhere; the vLLM server only where its wheel's ops load.
        python = vllm_python() if args.no_vllm else vllm_engine_python()
    except KeyError as error:
        parser.error(f"--workloads: unknown {error}; known: {', '.join(WORKLOADS)}")
    except PeerUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    configs = [Path(c).resolve() for c in args.configs.split(",") if c]
    models = {ClusterConfig.from_yaml(c).model for c in configs}
    if len(models) != 1:
        parser.error(f"the configs serve different models: {sorted(map(str, models))}")
    model_dir = Path(models.pop())
    model_name = model_dir.name
    servers: dict[str, Server] = {}
    for config in configs:
        server = pdserve_server(config, PORT)
        servers[server.label] = server
    peer = vllm_server(python, model_dir, model_name, "float32", PORT)
    if not args.no_vllm:
        servers[peer.label] = peer

    runs: list[dict[str, object]] = []
    total = len(workloads) * len(seeds) * len(servers) * len(rates)
    started = time.monotonic()
    for workload in workloads:
        for seed_index, seed in enumerate(seeds):
            for label in server_order(list(servers), seed_index):
                server = servers[label]
                log = args.logs / f"{label.replace(' ', '_')}-{workload.name}-{seed}.log"
                print(f"[serving] starting {label} (log: {log})", file=sys.stderr, flush=True)
                with running(server, PORT, log) as process:
                    for rate_index, rate in enumerate(rates):
                        result_path = (
                            args.logs
                            / "results"
                            / (f"{label.replace(' ', '_')}-{workload.name}-{seed}-{rate:g}.json")
                        )
                        command = client_command(
                            python,
                            result_path,
                            port=PORT,
                            model_dir=model_dir,
                            model_name=model_name,
                            workload=workload,
                            rate=rate,
                            num_prompts=args.num_prompts,
                            seed=client_seed(seed, rate_index),
                        )
                        with (
                            (args.logs / "client.log").open("a") as client_log,
                            TreeSampler(process.pid) as sampler,
                        ):
                            done = subprocess.run(
                                command, stdout=client_log, stderr=subprocess.STDOUT, check=False
                            )
                        if done.returncode != 0:
                            print(
                                f"error: the client failed ({done.returncode}); "
                                f"see {args.logs / 'client.log'}",
                                file=sys.stderr,
                            )
                            return 1
                        result = json.loads(result_path.read_text())
                        metrics = keep(result)
                        # Over the load itself, not the client's start.
                        cpu = sampler.cores_over(float(result["duration"]))
                        runs.append(
                            {
                                "workload": workload.name,
                                "server": label,
                                "seed": seed,
                                "rate": rate,
                                "metrics": metrics,
                                "server_cores": cpu,
                            }
                        )
                        elapsed = time.monotonic() - started
                        print(
                            f"[serving] {len(runs)}/{total} {workload.name} seed {seed} "
                            f"{label} @ {rate:g} req/s: "
                            f"TPOT p50 {metrics['p50_tpot_ms']:.0f} ms, "
                            f"p99 {metrics['p99_tpot_ms']:.0f} ms, "
                            f"TTFT p99 {metrics['p99_ttft_ms']:.0f} ms, "
                            f"{metrics['request_throughput']:.2f} req/s done; server cores "
                            f"{sum(cpu.values()):.2f} ({format_cores(cpu)}) "
                            f"({elapsed / 60:.0f} min)",
                            file=sys.stderr,
                            flush=True,
                        )
                        save(args.json, {"runs": runs})
    merged = [run for earlier in args.merge for run in json.loads(earlier.read_text())["runs"]]
    table = medians([*runs, *merged])
    rows = verdicts(table, peer.label)
    payload = {
        "model": str(model_dir),
        "workloads": {w.name: vars(w) for w in workloads},
        "rates": rates,
        "seeds": seeds,
        "num_prompts": args.num_prompts,
        "runs": runs,
        "merged_from": [str(m) for m in args.merge],
        "medians": [
            {"workload": w, "server": s, "rate": r, **m} for (w, s, r), m in sorted(table.items())
        ],
        "comparison": rows,
    }
    save(args.json, payload)
    if rows:
        print(format_rows(rows))
    print(f"results: {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
