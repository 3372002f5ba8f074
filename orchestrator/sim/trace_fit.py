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

ROLES = ("prefill", "decode", "mixed")
POINT_FIELDS = ["prefill_tokens", "prefill_attention", "decode_seqs", "decode_kv_tokens", "seconds"]


def busy_cycles(trace: dict[str, Any]) -> Iterator[list[float]]:
    """``[prefill_tokens, attention, decode_seqs, kv_tokens, seconds]`` of each step of one
    worker's trace: its busy cycle where one follows (the next record's loop did not wait
    first), else the step's own duration."""
    records = trace["records"]
    for current, following in itertools.pairwise(records):
        start, duration, _, *shape = current
        next_start, _, after_wait, *_ = following
        busy = not after_wait and next_start > start
        yield [*shape, next_start - start if busy else duration]
    if records:
        _, duration, _, *shape = records[-1]
        yield [*shape, duration]


def role_points(documents: Sequence[dict[str, Any]]) -> dict[str, list[list[float]]]:
    """Busy cycles of every traced worker of every run of ``documents``, by worker role."""
    points: dict[str, list[list[float]]] = {}
    for document in documents:
        for run in document["runs"]:
            for trace in run.get("step_traces") or []:
                if "error" in trace:
                    continue  # the worker was lost before its trace was read
                if trace["role"] not in ROLES:
                    raise ValueError(f"step trace of unknown role {trace['role']!r}")
                points.setdefault(trace["role"], []).extend(busy_cycles(trace))
    return points


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


def calibration_from_traces(paths: Sequence[str | Path]) -> dict[str, Any]:
    """The calibration file's data (see `calibrated`) from saved ``bench compare`` results."""
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
    points = role_points(documents)
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
    return {
        **model_facts(config),
        "from_trace": {"results": [Path(p).name for p in paths], "fields": POINT_FIELDS},
        "roles": points,
    }
