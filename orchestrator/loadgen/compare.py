"""``pdserve bench compare``: the same workload against a disaggregated and a colocated cluster,
one after the other in this process (`orchestrator.control.app.ServingApp` on embedded Ray; the first
is stopped, Ray included, before the second starts), then the ratios against the issue's
targets: disaggregated p99 ITL <= 0.5x colocated, per-request decode tok/s >= 1.8x. TTFT p50
and throughput ratios are reported without a target (disaggregation is expected to cost TTFT).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.config.cluster import ClusterConfig
from orchestrator.loadgen.report import machine_load
from orchestrator.loadgen.runner import RunOutcome
from orchestrator.loadgen.session import BenchOptions, measure

logger = logging.getLogger(__name__)

# (name, path in the summary, target ratio disaggregated / colocated, "<=" or ">=" or None)
RATIOS: tuple[tuple[str, tuple[str, ...], float | None, str | None], ...] = (
    ("ITL p99", ("itl_s", "p99"), 0.5, "<="),
    ("decode tok/s per request (mean)", ("decode_tokens_per_s_per_request", "mean"), 1.8, ">="),
    ("TTFT p50", ("ttft_s", "p50"), None, None),
    ("TTFT p99", ("ttft_s", "p99"), None, None),
    ("output tok/s", ("output_token_throughput",), None, None),
    ("goodput", ("goodput",), None, None),
)


@dataclass
class ClusterRun:
    name: str
    config: ClusterConfig
    outcome: RunOutcome
    summary: dict[str, Any]
    load_before: str
    load_after: str
    # Every worker's recent engine steps at the end of the run (`workers.engine.step_trace`):
    # what `pdserve calibrate --from-trace` fits the simulator's step costs to.
    step_traces: list[dict[str, Any]]


def load_config(path: str | Path, model: str | Path | None) -> ClusterConfig:
    config = ClusterConfig.from_yaml(path)
    return config.with_overrides(model=model) if model is not None else config


@asynccontextmanager
async def serving(
    name: str, config: ClusterConfig, num_cpus: int | None = None
) -> AsyncIterator[tuple[Any, str, str | None]]:
    """A started cluster: (the `ServingApp`, its router's gRPC address, its HTTP base URL),
    stopped on leaving, Ray too (embedded): nothing of this cluster outlives the block."""
    from orchestrator.control.app import AppOptions, ServingApp

    app = ServingApp(config, AppOptions(num_cpus=num_cpus))
    try:
        address = await app.start()
        http_url = f"http://{app.http_address}" if app.http_address else None
        logger.info("%s cluster serving on %s; running the workload", name, address)
        yield app, address, http_url
    finally:
        await app.stop()


async def run_cluster(
    name: str, config: ClusterConfig, options: BenchOptions, num_cpus: int | None = None
) -> ClusterRun:
    load_before = machine_load()
    async with serving(name, config, num_cpus) as (app, address, http_url):
        try:
            outcome, summary = await measure(address, http_url, options)
            traces = await step_traces(app)
        finally:
            load_after = machine_load()
    return ClusterRun(name, config, outcome, summary, load_before, load_after, traces)


async def step_traces(app: Any) -> list[dict[str, Any]]:
    """The step trace of every worker the controller knows (a TP group: its leader's)."""
    traces = []
    for record in app.controller.registry.workers.values():
        handle = app.controller.handle_of(record.worker_id)
        try:
            traces.append(await handle.step_trace.remote())
        except Exception as error:  # a worker lost at the end: the run's figures still count
            logger.warning("no step trace from %s: %r", record.worker_id, error)
            traces.append(
                {"worker_id": record.worker_id, "role": record.role, "error": repr(error)}
            )
    return traces


def ratios(disaggregated: dict[str, Any], colocated: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for name, path, target, sense in RATIOS:
        a, b = _get(disaggregated, path), _get(colocated, path)
        ratio = a / b if a is not None and b else None
        verdict = None
        if target is not None and ratio is not None:
            met = ratio <= target if sense == "<=" else ratio >= target
            verdict = "PASS" if met else "MISS"
        rows.append(
            {
                "metric": name,
                "disaggregated": a,
                "colocated": b,
                "ratio": ratio,
                "target": None if target is None else f"{sense} {target}",
                "verdict": verdict,
            }
        )
    return rows


def format_ratios(rows: list[dict[str, Any]]) -> str:
    def cell(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.4g}"

    lines = [
        f"{'metric':<33} {'disagg':>10} {'coloc':>10} {'ratio':>7}  target",
    ]
    for row in rows:
        target = f"{row['target']}: {row['verdict']}" if row["target"] else "(reported)"
        lines.append(
            f"{row['metric']:<33} {cell(row['disaggregated']):>10} {cell(row['colocated']):>10} "
            f"{cell(row['ratio']):>7}  {target}"
        )
    return "\n".join(lines)


def _get(summary: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = summary
    for part in path:
        value = value[part]
    return None if value is None else float(value)
