"""Fixed per-request costs outside engine steps, derived from a measured ``compare`` run.

The simulator's TTFT ends when the engine samples the first token; the measured one also
holds the router, the gRPC calls, the first message's way back to the client and, in the
disaggregated mode, the decode worker's admission of the pushed KV. Those are measured here
as residuals: a request that had the cluster to itself (no other request in flight between
its send and its first token) saw no queueing, so its measured TTFT minus the simulated TTFT
of the same request alone on the same layout is the fixed cost plus the cost model's own
error at idle. The median over such requests (warm-up ones included: they are the likeliest
to be alone), clipped at 0, is the overhead of that cluster kind.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from orchestrator.config.cluster import ClusterConfig
from orchestrator.sim.cost import CostModel
from orchestrator.sim.workload import RequestSpec


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


def derive(cost: CostModel, document: dict[str, Any], source: str) -> dict[str, Any]:
    """The ``overheads`` entry of a calibration file from a saved ``compare`` result.

    ``cost`` must carry no overhead of its own (the residuals are measured against it).
    """
    from orchestrator.loadgen.compare import load_config

    if document.get("command") != "compare":
        raise ValueError(f"{source} is not a pdserve bench compare result")
    if cost.request_overhead_seconds(True) or cost.request_overhead_seconds(False):
        raise ValueError("derive overheads against a cost model without overheads")
    entry: dict[str, Any] = {"from": source}
    for run in document["runs"]:
        config = load_config(document["configs"][run["name"]], None)
        found = residuals(cost, config, run.get("requests") or [])
        entry[f"{found.kind}_s"] = found.overhead
        entry[f"{found.kind}_requests"] = len(found.seconds)
    return entry
