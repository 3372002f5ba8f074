"""Costs outside engine steps, derived from a measured ``compare`` run: a fixed one per request,
and the varying delay of each streamed token on its way to the client.

The simulator's TTFT ends when the engine samples the first token; the measured one also
holds the router, the gRPC calls, the first message's way back to the client and, in the
disaggregated mode, the decode worker's admission of the pushed KV. Those are measured here
as residuals: a request that had the cluster to itself (no other request in flight between
its send and its first token) saw no queueing, so its measured TTFT minus the simulated TTFT
of the same request alone on the same layout is the fixed cost plus the cost model's own
error at idle. The median over such requests (warm-up ones included: they are the likeliest
to be alone), clipped at 0, is the overhead of that cluster kind.

The token delay (`orchestrator.sim.delivery`) is fitted after it, per cluster kind: the mean at
which the simulated ITL p99 of the whole run (each figure the median over `FIT_NOISE_SEEDS` of
the step-time noise, as `pdserve bench validate --noise-repeats 6` judges it) equals the
measured one, by bisection; 0 when the engine steps alone reach it. One number fitted to one
figure in sample: the check is on other runs.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from orchestrator.config.cluster import ClusterConfig
from orchestrator.sim.calibrated import CalibratedCostModel
from orchestrator.sim.cost import CostModel
from orchestrator.sim.workload import RequestSpec

FIT_NOISE_SEEDS = range(6)  # step-time noise draws per simulated figure of the delay's fit
DELAY_HALVINGS = 12  # bisection steps: the delay to 1/4096 of the measured ITL p99


@dataclass(frozen=True)
class Residuals:
    """Measured minus simulated TTFT (seconds) of the requests that were alone."""

    kind: str  # "disaggregated" or "mixed"
    seconds: tuple[float, ...]

    @property
    def overhead(self) -> float:
        return max(0.0, statistics.median(self.seconds)) if self.seconds else 0.0


def isolated(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Completed requests with no other request in flight from their send to their first
    token (an errored or unfinished request counts as in flight to the end of the run)."""
    done = [r for r in requests if r.get("error") is None and r.get("ttft_s") is not None]
    end = max((r["sent_s"] + (r.get("e2e_s") or 0.0) for r in requests), default=0.0)

    def span(r: dict[str, Any]) -> tuple[float, float]:
        e2e = r.get("e2e_s")
        return r["sent_s"], end if e2e is None or r.get("error") else r["sent_s"] + e2e

    alone = []
    for request in done:
        start, first = request["sent_s"], request["sent_s"] + request["ttft_s"]
        others = (span(o) for o in requests if o is not request)
        if all(o_end <= start or o_start >= first for o_start, o_end in others):
            alone.append(request)
    return alone


def residuals(cost: CostModel, config: ClusterConfig, requests: list[dict[str, Any]]) -> Residuals:
    from orchestrator.loadgen.validate import simulator_for

    seconds = []
    for request in isolated(requests):
        spec = RequestSpec(0, 0.0, int(request["prompt_tokens"]), int(request["output_tokens"]))
        alone = simulator_for(cost, config).run([spec]).records[0]
        seconds.append(float(request["ttft_s"]) - alone.ttft)
    kind = "disaggregated" if config.is_disaggregated else "mixed"
    return Residuals(kind, tuple(seconds))


def token_delay(
    cost: CalibratedCostModel,
    config: ClusterConfig,
    specs: list[RequestSpec],
    num_warmup: int,
    measured_itl_p99: float,
    acceptance: Sequence[float] | None = None,
) -> float:
    """The mean token delay at which the simulated ITL p99 of ``specs`` on ``config`` is the
    measured one (at most that p99 itself); 0 when the steps alone reach it."""
    from orchestrator.loadgen.validate import predict

    def simulated(mean: float) -> float:
        model = replace(cost, token_delay_s=(mean, mean))
        prediction = predict(model, config, specs, num_warmup, FIT_NOISE_SEEDS, acceptance)
        return prediction["itl_p99_s"]

    if not measured_itl_p99 > 0 or simulated(0.0) >= measured_itl_p99:
        return 0.0
    low, high = 0.0, measured_itl_p99
    if simulated(high) <= measured_itl_p99:
        return high
    for _ in range(DELAY_HALVINGS):
        middle = (low + high) / 2
        low, high = (middle, high) if simulated(middle) < measured_itl_p99 else (low, middle)
    return (low + high) / 2


def derive(cost: CalibratedCostModel, document: dict[str, Any], source: str) -> dict[str, Any]:
    """The ``overheads`` entry of a calibration file from a saved ``compare`` result.

    ``cost`` must carry no overhead of its own (the residuals are measured against it).
    """
    from orchestrator.loadgen.compare import load_config
    from orchestrator.loadgen.requests import document_specs
    from orchestrator.loadgen.validate import acceptance_of

    if document.get("command") != "compare":
        raise ValueError(f"{source} is not a pdserve bench compare result")
    if cost.request_overhead_s != (0.0, 0.0) or cost.token_delay_s != (0.0, 0.0):
        raise ValueError("derive overheads against a cost model without overheads")
    specs, num_warmup = document_specs(document)
    if any(spec.num_common_tokens or spec.conversation >= 0 for spec in specs):
        from workers.log import warn

        # The residuals' requests are simulated alone and sharing nothing, while the run's
        # found most of their prompts cached: the fixed cost comes out too low, often 0.
        warn(
            f"{source}: its prompts share cached prefixes; the fixed per-request cost is "
            "fitted to requests simulated sharing nothing (derive it from a run that shares "
            "nothing, or use none)"
        )
    entry: dict[str, Any] = {"from": source}
    for run in document["runs"]:
        config = load_config(document["configs"][run["name"]], None)
        found = residuals(cost, config, run.get("requests") or [])
        entry[f"{found.kind}_s"] = found.overhead
        entry[f"{found.kind}_requests"] = len(found.seconds)
        with_overhead = replace(cost, request_overhead_s=(found.overhead, found.overhead))
        measured = float((run.get("summary") or {}).get("itl_s", {}).get("p99") or 0.0)
        acceptance = acceptance_of(run.get("step_traces") or [])
        entry[f"{found.kind}_token_s"] = token_delay(
            with_overhead, config, specs, num_warmup, measured, acceptance
        )
    return entry
