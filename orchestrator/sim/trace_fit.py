"""``pdserve calibrate --from-trace``: step costs fitted to the step traces of measured runs.

A calibration run times an engine on its own (or beside background engines that step without
pause). In a serving cluster on shared cores a step costs something else: the other workers'
load comes and goes, prefill workers may run at a lower CPU priority (`GroupConfig.nice`), and
each worker's messenger, gRPC and fabric threads take their share. `pdserve bench compare`
saves every worker's step trace (`workers.engine.step_trace`) with its result; this module
turns the traces of one or more such results into a calibration file whose fits are per
worker role, so that the simulator prices a prefill instance's steps as the prefill workers'
steps went, a decode instance's as the decode workers' went, and a mixed instance's as the
colocated workers' went (`calibrated.CalibratedCostModel.role_coefficients`).

What is fitted is a *busy cycle*: from a step's start to the next step's start while the step
loop did not go idle in between (the step, the hand-off of its outputs, and the loop's work
between steps: messenger polls, KV admission, calls from other threads). That is the time the
simulator's back-to-back steps stand for. A step after which the loop went idle ends no cycle;
its own duration stands for it. Those are often a prompt's last, short chunk: left out, a
prefill worker's points were nearly all full chunks, and a fit could put their whole cost in
the intercept and price a 10-token chunk like a 256-token one (bench/history/RESULTS-notebook.md, "Step-time
noise in seconds"). Per role: seconds = a + b * prefill tokens + c * prefill attention
+ d * decode sequences + e * decode KV tokens, least squares with coefficients >= 0
(`calibrated.fit_affine`).

With ``--shared-cores C`` (the cores of the machine the runs were measured on), each busy
cycle's seconds become the core-seconds the worker got in it (`shared_cores.alone_seconds`,
every worker of a run on one clock, each weighted by its group's ``nice``), and the file
records ``"shared_cores": {"cores": C, "nice": {role: nice}}``: the simulator then runs a
step's core-seconds at the share of a core it gets beside the instances in a step, re-divided
as their steps start and end (`shared_cores.ProcessorSharing`), so that a layout with fewer
(or more) processes per core than the measured ones is priced with its own contention.

Predicting the run a trace was taken from checks the simulator's queueing and batching, given
the step costs the run actually had; predicting other runs with it (other repeats of the same
compare) also checks that those costs carry over.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from orchestrator.config.cluster import ClusterConfig
from orchestrator.sim.calibrated import MIN_ROLE_POINTS
from orchestrator.sim.shared_cores import alone_seconds, nice_weight

ROLES = ("prefill", "decode", "mixed")
POINT_FIELDS = ["prefill_tokens", "prefill_attention", "decode_seqs", "decode_kv_tokens", "seconds"]


def busy_cycles(trace: dict[str, Any]) -> Iterator[tuple[float, list[float]]]:
    """``(start, [prefill_tokens, attention, decode_seqs, kv_tokens, seconds])`` of each step
    of one worker's trace: its busy cycle where one follows (the next record's loop did not
    wait first), else the step's own duration."""
    records = trace["records"]
    for current, following in itertools.pairwise(records):
        start, duration, _, *shape = current
        next_start, _, after_wait, *_ = following
        busy = not after_wait and next_start > start
        yield start, [*shape, next_start - start if busy else duration]
    if records:
        start, duration, _, *shape = records[-1]
        yield start, [*shape, duration]


def role_points(
    documents: Sequence[dict[str, Any]], cores: float | None = None
) -> tuple[dict[str, list[list[float]]], dict[str, int]]:
    """Busy cycles of every traced worker of every run of ``documents``, by worker role; with
    ``cores``, in core-seconds (`shared_cores.alone_seconds`), and each role's ``nice`` in the
    runs' configs."""
    points: dict[str, list[list[float]]] = {}
    nice: dict[str, int] = {}
    for document in documents:
        for run in document["runs"]:
            traces = [t for t in run.get("step_traces") or [] if "error" not in t]
            # (A worker lost before its trace was read has an "error" instead.)
            for trace in traces:
                if trace["role"] not in ROLES:
                    raise ValueError(f"step trace of unknown role {trace['role']!r}")
            cycles = [list(busy_cycles(trace)) for trace in traces]
            if cores is not None and traces:
                run_nice = _role_nice(document, run["name"], nice)
                _to_core_seconds(traces, cycles, run_nice, cores)
            for trace, worker in zip(traces, cycles, strict=True):
                points.setdefault(trace["role"], []).extend(point for _, point in worker)
    return points, nice


def _role_nice(document: dict[str, Any], run_name: str, seen: dict[str, int]) -> dict[str, int]:
    """Each role's ``nice`` in the config that ``run_name`` of ``document`` served, added to
    ``seen``; ValueError where an earlier run's group of that role had another."""
    from orchestrator.loadgen.compare import load_config

    config = load_config(document["configs"][run_name], document.get("model"))
    for group in config.groups:
        if seen.setdefault(group.role, group.nice) != group.nice:
            raise ValueError(
                f"the traced runs' {group.role} groups run at different nice levels: "
                "calibrate each setting on its own"
            )
    return {group.role: group.nice for group in config.groups}


def _to_core_seconds(
    traces: Sequence[dict[str, Any]],
    cycles: Sequence[list[tuple[float, list[float]]]],
    nice: dict[str, int],
    cores: float,
) -> None:
    """Replace the seconds of each busy cycle of one run's workers by its core-seconds."""
    workers = [
        (nice_weight(nice[trace["role"]]), [(start, point[-1]) for start, point in worker])
        for trace, worker in zip(traces, cycles, strict=True)
    ]
    for worker, alone in zip(cycles, alone_seconds(workers, cores), strict=True):
        for (_, point), seconds in zip(worker, alone, strict=True):
            point[-1] = seconds


def model_facts(config: ClusterConfig) -> dict[str, Any]:
    """num_layers, kv_bytes_per_token and kv_capacity_tokens of the cluster's model and pool."""
    from workers.engine.config import DEFAULT_KV_MEMORY_BYTES
    from workers.engine.kv_cache import num_pages_for_budget, page_nbytes
    from workers.engine.loader import resolve_dtype
    from workers.engine.model_config import ModelConfig

    model = ModelConfig.from_dir(config.model)
    dtype = resolve_dtype(config.dtype, model)
    limits = config.limits
    num_pages = limits.num_pages or num_pages_for_budget(
        model, config.page_size, dtype, limits.kv_memory_bytes or DEFAULT_KV_MEMORY_BYTES
    )
    return {
        "model": Path(config.model).name,
        "num_layers": model.num_layers,
        "kv_bytes_per_token": page_nbytes(model, 1, dtype),
        "kv_capacity_tokens": num_pages * config.page_size,
    }


def calibration_from_traces(
    paths: Sequence[str | Path], shared_cores: float | None = None
) -> dict[str, Any]:
    """The calibration file's data (see `calibrated`) from saved ``bench compare`` results;
    ``shared_cores``: the cores the runs shared (points in core-seconds, see above)."""
    from orchestrator.loadgen.compare import load_config

    documents = []
    for path in paths:
        try:
            document = json.loads(Path(path).read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not JSON ({error})") from None
        if document.get("command") != "compare":
            raise ValueError(f"{path} is not a pdserve bench compare result")
        documents.append(document)
    if shared_cores is not None and not shared_cores > 0:
        raise ValueError(f"--shared-cores must be > 0, got {shared_cores}")
    points, nice = role_points(documents, shared_cores)
    if not points:
        raise ValueError(
            "no step traces in "
            + ", ".join(str(p) for p in paths)
            + " (results of a pdserve bench compare that saved none: rerun it)"
        )
    for role, found in points.items():
        if len(found) < MIN_ROLE_POINTS:
            raise ValueError(f"only {len(found)} busy cycles of {role} workers: too few to fit")
    first = documents[0]
    config = load_config(first["configs"]["disaggregated"], first.get("model"))
    data = {
        **model_facts(config),
        "from_trace": {
            "results": [Path(p).name for p in paths],
            "fields": POINT_FIELDS,
            # Arrivals per second of the runs (a multi-turn run's are conversations: none).
            "rates": [
                workload["rate"]
                for workload in (d.get("workload") for d in documents)
                if workload and not str(workload.get("prompt", "")).startswith("multiturn")
            ],
        },
        "roles": points,
    }
    if shared_cores is not None:
        data["shared_cores"] = {"cores": shared_cores, "nice": nice}
    return data
