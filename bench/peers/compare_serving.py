"""``bench/serving.py``: OpenAI servers under Poisson load, measured by one client.

Each server (``pdserve serve CONFIG`` or ``vllm serve``) runs alone on the machine, is started,
warmed by the client's own first request, driven at every rate, and stopped; the client is
vLLM's serving benchmark (`vllm_client.py`, in vLLM's venv), so both servers are measured by the
same code, over HTTP, from the first byte of the request to the last streamed token. The server
order turns with every seed (A B, B A, ...) so that a drift in the machine's load hits all
sides. Figures per (workload, server, rate) are medians over seeds; ratios are ours / vLLM's.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CLIENT = Path(__file__).with_name("vllm_client.py")

# Client result keys kept per run (vLLM's names).
METRICS = (
    "completed",
    "failed",
    "request_throughput",
    "output_throughput",
    "p50_ttft_ms",
    "p99_ttft_ms",
    "p50_tpot_ms",
    "p99_tpot_ms",
    "p50_itl_ms",
    "p99_itl_ms",
)


@dataclass(frozen=True)
class Workload:
    name: str
    input_len: int
    output_len: int
    range_ratio: float  # lengths uniform in [len * (1 - r), len * (1 + r)]

    def client_args(self) -> list[str]:
        return [
            "--dataset-name",
            "random",
            "--random-input-len",
            str(self.input_len),
            "--random-output-len",
            str(self.output_len),
            "--random-range-ratio",
            str(self.range_ratio),
            "--ignore-eos",
        ]


WORKLOADS = {
    # vLLM's own default-style random workload: fixed 256-token prompts, 64 new tokens.
    "random-256-64": Workload("random-256-64", 256, 64, 0.0),
    # Chat-like: shorter prompts, longer answers, both varied.
    "chat": Workload("chat", 96, 160, 0.5),
}


@dataclass(frozen=True)
class Server:
    """One way of serving the model: ``pdserve:CONFIG`` or ``vllm``."""

    label: str
    command: list[str]
    env: dict[str, str]
    is_ours: bool


def pdserve_server(config: Path, port: int) -> Server:
    return Server(
        label=f"pdserve {config.stem}",
        command=[
            sys.executable,
            "-m",
            "orchestrator.cli",
            "-q",
            "serve",
            str(config),
            "--http-address",
            f"127.0.0.1:{port}",
            "--address",
            f"127.0.0.1:{port + 1}",
        ],
        env={},
        is_ours=True,
    )


def vllm_server(python: Path, model_dir: Path, model_name: str, dtype: str, port: int) -> Server:
    return Server(
        label=f"vllm serve ({dtype})",
        command=[
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            model_name,
            "--dtype",
            dtype,
            "--max-model-len",
            "2048",
            "--gpu-memory-utilization",
            "0.3",
            "--port",
            str(port),
        ],
        # The CPU build sizes its KV cache from this (GiB) rather than from a memory fraction.
        env={"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_LOGGING_LEVEL": "WARNING"},
        is_ours=False,
    )


def wait_ready(port: int, process: subprocess.Popen[bytes], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with status {process.returncode} before serving")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise RuntimeError(f"server on port {port} not ready after {timeout:.0f} s")


@contextmanager
def running(server: Server, port: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The server in a session of its own (a signal reaches all its processes), its output in
    ``log``; SIGINT at the end, SIGKILL to the session if it has not stopped in 60 s."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        process = subprocess.Popen(
            server.command,
            cwd=ROOT,
            env={**os.environ, **server.env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_ready(port, process)
            yield process
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGINT)
                try:
                    process.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
            time.sleep(2.0)  # let the OS reclaim the ports and the memory


def client_command(
    python: Path,
    result: Path,
    *,
    port: int,
    model_dir: Path,
    model_name: str,
    workload: Workload,
    rate: float,
    num_prompts: int,
    seed: int,
) -> list[str]:
    return [
        str(python),
        str(CLIENT),
        "--result",
        str(result),
        "--",
        "--backend",
        "openai",
        "--endpoint",
        "/v1/completions",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        model_name,
        "--tokenizer",
        str(model_dir),
        *workload.client_args(),
        "--num-prompts",
        str(num_prompts),
        "--request-rate",
        str(rate),
        "--seed",
        str(seed),
        "--temperature",
        "0",
        "--percentile-metrics",
        "ttft,tpot,itl",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
    ]


def keep(result: dict[str, Any]) -> dict[str, float]:
    return {key: float(result.get(key) or 0.0) for key in METRICS}


def client_seed(seed: int, rate_index: int) -> int:
    """The client's seed for a seed's run at its ``rate_index``-th rate: the prompts (and
    arrivals) differ from rate to rate, since a server that saw a prompt list at one rate would
    answer it from its prefix cache at the next (both servers cache prefixes). The first rate
    keeps the seed itself."""
    return seed + 1000 * rate_index


def server_order(labels: Sequence[str], seed_index: int) -> list[str]:
    """The servers rotated by one per seed: A B C, B C A, C A B, ..."""
    shift = seed_index % len(labels) if labels else 0
    return [*labels[shift:], *labels[:shift]]


def medians(runs: Sequence[dict[str, Any]]) -> dict[tuple[str, str, float], dict[str, float]]:
    """(workload, server, rate) -> the median over seeds of every metric."""
    grouped: dict[tuple[str, str, float], list[dict[str, float]]] = {}
    for run in runs:
        key = (run["workload"], run["server"], float(run["rate"]))
        grouped.setdefault(key, []).append(run["metrics"])
    return {
        key: {m: statistics.median(r[m] for r in results) for m in METRICS}
        for key, results in grouped.items()
    }


# (metric, lower is better) compared in the table; ratio = ours / vLLM.
COMPARED = (
    ("p50_tpot_ms", True),
    ("p99_tpot_ms", True),
    ("p99_ttft_ms", True),
    ("request_throughput", False),
)


def verdicts(
    table: dict[tuple[str, str, float], dict[str, float]], peer: str
) -> list[dict[str, Any]]:
    """One row per (workload, our server, rate) with vLLM's figures beside ours, the ratio of
    each compared metric and whether ours is at least as good (``met``). Completed req/s is
    judged at the highest rate only (overload): below it both complete what is offered."""
    rows: list[dict[str, Any]] = []
    top_rate = max((rate for _, _, rate in table), default=0.0)
    for (workload, server, rate), ours in sorted(table.items()):
        if server == peer or (workload, peer, rate) not in table:
            continue
        theirs = table[(workload, peer, rate)]
        row: dict[str, Any] = {"workload": workload, "server": server, "rate": rate}
        for metric, lower_better in COMPARED:
            mine, their = ours[metric], theirs[metric]
            met: bool | None = mine <= their if lower_better else mine >= their
            if metric == "request_throughput" and rate != top_rate:
                met = None
            row[metric] = {
                "ours": mine,
                "vllm": their,
                "ratio": mine / their if their else float("inf"),
                "met": met,
            }
        rows.append(row)
    return rows


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    header = (
        "| workload | server | req/s offered | TPOT p50 ms (ours / vLLM) | TPOT p99 ms | "
        "TTFT p99 ms | completed req/s |\n|---|---|---|---|---|---|---|"
    )
    lines = [header]
    for row in rows:
        cells = []
        for metric, _ in COMPARED:
            cell = row[metric]
            mark = " ✗" if cell["met"] is False else ""
            cells.append(
                f"{cell['ours']:.0f} / {cell['vllm']:.0f} = {cell['ratio']:.2f}x{mark}"
                if metric != "request_throughput"
                else f"{cell['ours']:.2f} / {cell['vllm']:.2f} = {cell['ratio']:.2f}x{mark}"
            )
        lines.append(
            f"| {row['workload']} | {row['server']} | {row['rate']:g} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def save(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)
