"""The JSON result file's shape and the PNG plot (matplotlib, Agg)."""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.loadgen.records import RequestResult
from orchestrator.loadgen.report import SCHEMA_VERSION, run_document, write_json, write_plot
from orchestrator.loadgen.runner import RunOutcome
from orchestrator.loadgen.stats import SLOs, summarize


def _outcome(name: str, itl: float) -> RunOutcome:
    results = []
    for i in range(6):
        result = RequestResult(i, i == 0, i * 0.5, 16, 4, sent_s=i * 0.5)
        result.chunks = [(i * 0.5 + 0.2 + k * itl, 1) for k in range(4)]
        result.finish_s = result.chunks[-1][0]
        result.finish_reason = "length"
        results.append(result)
    return RunOutcome(name, results, cap_hits=0, max_concurrency=8, wall_s=4.0)


def test_json_document_round_trips_with_every_request(tmp_path: Path) -> None:
    outcome = _outcome("grpc", 0.05)
    summary = summarize(outcome.results, SLOs(1.0, 0.1))
    path = tmp_path / "out" / "result.json"
    write_json(path, {"command": "run", "runs": [run_document("grpc", outcome, summary)]})
    document = json.loads(path.read_text())
    assert document["schema_version"] == SCHEMA_VERSION
    (run,) = document["runs"]
    assert run["backend"] == "grpc" and run["max_concurrency"] == 8
    assert len(run["requests"]) == 6
    first = run["requests"][1]
    assert first["output_tokens"] == 4 and first["error"] is None
    assert first["ttft_s"] > 0 and first["tpot_s"] > 0 and len(first["chunks"]) == 4
    stats = run["summary"]
    for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s", "decode_tokens_per_s_per_request"):
        assert set(stats[key]) == {"mean", "p50", "p90", "p99"}
    for key in ("sent", "completed", "errored", "errors_by_code", "goodput", "cap_hits"):
        assert key in stats
    assert stats["sent"] == 6 and stats["completed"] == 6


def test_plot_is_a_png(tmp_path: Path) -> None:
    path = tmp_path / "plot.png"
    write_plot(
        path, [("disaggregated", _outcome("grpc", 0.02)), ("colocated", _outcome("grpc", 0.1))]
    )
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000
