"""``pdserve bench sweep``: SLO attainment, medians over seeds, the goodput rate and its
bisection (pure, on hand-made runs), the document, table and plot built from them, the
command's argument errors, and one real sweep of two tiny clusters."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.cli.main import main
from orchestrator.loadgen.goodput import (
    Goodput,
    SweepRun,
    attainment,
    bracket,
    find_goodput,
    goodput_ratio,
    median_metrics,
    rate_medians,
    run_metrics,
)
from orchestrator.loadgen.records import RequestResult
from orchestrator.loadgen.requests import build_requests
from orchestrator.loadgen.session import BenchOptions
from orchestrator.loadgen.stats import SLOs, summarize
from orchestrator.loadgen.sweep import SweepPlan
from orchestrator.loadgen.sweep_command import parse_rates, parse_seeds
from orchestrator.loadgen.sweep_report import format_table, sweep_document, write_sweep_plot
from orchestrator.sim.workload import LengthDist, Workload
from tests.system.cluster_helpers import disaggregated_groups, mixed_groups

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _request(index: int, ttft: float, tpot: float, *, warmup: bool = False) -> RequestResult:
    """A finished 5-token request sent at 0: first token at ``ttft``, then one every ``tpot``."""
    chunks = [(ttft + i * tpot, 1) for i in range(5)]
    return RequestResult(
        index, warmup, 0.0, 16, 5, sent_s=0.0, chunks=chunks, finish_s=chunks[-1][0]
    )


def test_attainment_counts_errored_requests_as_missing_and_leaves_out_the_warmup() -> None:
    slos = SLOs(ttft_s=1.0, tpot_s=0.1)
    errored = RequestResult(4, False, 0.0, 16, 5, error="UNAVAILABLE")
    results = [
        _request(0, 5.0, 0.5, warmup=True),  # misses both, but warm-up: not counted
        _request(1, 0.5, 0.05),  # meets both
        _request(2, 0.9, 0.09),  # meets both
        _request(3, 1.5, 0.05),  # TTFT too long
        errored,
        _request(5, 0.5, 0.2),  # TPOT too long
    ]
    summary = summarize(results, slos)
    assert attainment(summary) == pytest.approx(2 / 5)
    metrics = run_metrics(summary)
    assert metrics["slo_attainment"] == pytest.approx(0.4)
    assert metrics["errored"] == 1
    assert metrics["ttft_p50_s"] == pytest.approx(0.7)  # of 0.5, 0.9, 1.5 and 0.5
    assert metrics["tpot_mean_s"] == pytest.approx((0.05 + 0.09 + 0.05 + 0.2) / 4)
    assert metrics["itl_p99_s"] is not None and metrics["output_tok_s"] is not None
    # Nothing but errors: attainment 0, latencies absent (not 0).
    nothing = run_metrics(summarize([errored], slos))
    assert nothing["slo_attainment"] == 0.0
    assert nothing["ttft_p50_s"] is None and nothing["decode_tok_s_per_request"] is None


def test_median_over_seeds_skips_absent_figures() -> None:
    seeds = [
        {"slo_attainment": 1.0, "ttft_p99_s": 0.2, "itl_p99_s": None},
        {"slo_attainment": 0.85, "ttft_p99_s": 0.4, "itl_p99_s": None},
        {"slo_attainment": 0.88, "ttft_p99_s": None, "itl_p99_s": None},
    ]
    medians = median_metrics(seeds)
    # The mean (0.91) would pass 90%; the median (0.88) does not.
    assert medians["slo_attainment"] == pytest.approx(0.88)
    assert medians["ttft_p99_s"] == pytest.approx(0.3)  # of the two seeds that have one
    assert medians["itl_p99_s"] is None
    with pytest.raises(ValueError, match="no runs"):
        median_metrics([])


def _run(cluster: str, rate: float, seed: int, share: float, probe: bool = False) -> SweepRun:
    return SweepRun(cluster, rate, seed, probe, {"slo_attainment": share, "itl_p99_s": 0.01 * rate})


def test_rate_medians_group_by_cluster_and_rate() -> None:
    runs = [
        _run("disaggregated", 2.0, 0, 0.5),
        _run("disaggregated", 1.0, 0, 1.0),
        _run("disaggregated", 1.0, 1, 0.8),
        _run("disaggregated", 2.0, 1, 0.7),
        _run("disaggregated", 1.5, 0, 0.9, probe=True),
        _run("colocated", 1.0, 0, 0.6),
    ]
    rows = rate_medians(runs)
    assert [(r["cluster"], r["rate"], r["probe"], r["seeds"]) for r in rows] == [
        ("disaggregated", 1.0, False, [0, 1]),
        ("disaggregated", 1.5, True, [0]),
        ("disaggregated", 2.0, False, [0, 1]),
        ("colocated", 1.0, False, [0]),
    ]
    assert [r["metrics"]["slo_attainment"] for r in rows] == pytest.approx([0.9, 0.9, 0.6, 0.6])


class _Table:
    """A measurement of hand-made attainments: the rates asked for, in order, with the probe
    flag; each rate's attainment is the median of its seeds' (``seeds``), else ``law(rate)``."""

    def __init__(self, law: Any, seeds: dict[float, list[float]] | None = None) -> None:
        self.law = law
        self.seeds = seeds or {}
        self.asked: list[tuple[float, bool]] = []

    async def __call__(self, rate: float, probe: bool) -> float | None:
        self.asked.append((rate, probe))
        if rate in self.seeds:
            shares = [{"slo_attainment": s} for s in self.seeds[rate]]
            return median_metrics(shares)["slo_attainment"]
        share: float = self.law(rate)
        return share


def _search(table: _Table, rates: list[float], steps: int) -> Goodput:
    return asyncio.run(find_goodput(rates, steps, table))


def test_a_seeds_runs_at_two_rates_send_other_prompts_and_both_clusters_the_same() -> None:
    # Prefix caching is on by default: a seed's prompts sent again at the next rate would be
    # prefilled from the cache, and that run would measure the cache, not the rate.
    workload = Workload(1.0, 12, LengthDist.parse("uniform:8-64"), LengthDist.parse("fixed:4"))
    plan = SweepPlan(BenchOptions(workload, SLOs(4.0, 0.05)), rates=(0.5, 0.625, 1.0), seeds=(0,))

    def prompts(rate: float) -> list[tuple[int, ...]]:
        options = plan.options_at(rate, 0)
        requests = build_requests(options.workload, 320, prompt_stream=options.prompt_stream)
        return [r.prompt_token_ids for r in requests]

    at = {rate: prompts(rate) for rate in (0.5, 0.625, 1.0)}
    assert at[0.5] == prompts(0.5)  # the other cluster, at the same rate: the same prompts
    for a, b in ((0.5, 0.625), (0.625, 1.0), (0.5, 1.0)):
        assert all(x != y for x, y in zip(at[a], at[b], strict=True))
    assert [len(p) for p in at[0.5]] == [len(p) for p in at[1.0]]  # the seed's lengths
    with pytest.raises(ValueError, match="prompt_stream"):
        BenchOptions(workload, SLOs(4.0, 0.05), prompt_stream=-1)


def test_bisection_probes_between_the_last_passing_and_the_first_failing_rate() -> None:
    table = _Table(lambda rate: 1.0 if rate <= 3.2 else 0.5)
    goodput = _search(table, [1.0, 2.0, 4.0], steps=2)
    # Swept in order, then 3 (between 2 and 4: passes), then 3.5 (between 3 and 4: fails).
    assert table.asked == [(1.0, False), (2.0, False), (4.0, False), (3.0, True), (3.5, True)]
    assert goodput.kind == "bracketed"
    assert (goodput.passing, goodput.failing) == (2.0, 4.0)
    assert goodput.rate == 3.0 and goodput.upper == 3.5
    assert goodput.probes == ((3.0, 1.0), (3.5, 0.5))
    assert "3 req/s" in goodput.describe()
    # One step: the probe at 3 passes, and that is the answer.
    one = _search(_Table(table.law), [1.0, 2.0, 4.0], steps=1)
    assert (one.rate, one.upper) == (3.0, 4.0)
    # A failing probe keeps the swept rate.
    low = _search(_Table(lambda rate: 1.0 if rate <= 2.5 else 0.0), [1.0, 2.0, 4.0], steps=1)
    assert (low.rate, low.upper, low.probes) == (2.0, 3.0, ((3.0, 0.0),))


def test_no_bisection_is_the_highest_passing_swept_rate() -> None:
    table = _Table(lambda rate: 0.95 if rate < 3 else 0.2)
    goodput = _search(table, [1.0, 2.0, 4.0, 8.0], steps=0)
    assert [rate for rate, _ in table.asked] == [1.0, 2.0, 4.0, 8.0]  # every rate is swept
    assert (goodput.kind, goodput.rate, goodput.upper, goodput.probes) == (
        "bracketed",
        2.0,
        4.0,
        (),
    )


def test_no_rate_passes_gives_zero_and_no_probes() -> None:
    table = _Table(lambda rate: 0.5)
    goodput = _search(table, [0.5, 1.0], steps=3)
    assert table.asked == [(0.5, False), (1.0, False)]
    assert (goodput.kind, goodput.rate, goodput.passing, goodput.failing) == (
        "none",
        0.0,
        None,
        None,
    )
    assert goodput.describe().startswith("0 req/s")


def test_every_rate_passing_gives_the_highest_as_a_lower_bound() -> None:
    table = _Table(lambda rate: 1.0)
    goodput = _search(table, [0.5, 1.0], steps=3)
    assert table.asked == [(0.5, False), (1.0, False)]
    assert (goodput.kind, goodput.rate, goodput.failing) == ("at_least", 1.0, None)
    assert goodput.describe().startswith("at least 1 req/s")


def test_the_target_is_on_the_median_over_seeds_and_inclusive() -> None:
    # 1 and 2 req/s: exactly 90% passes. 4 req/s: seeds 1.0, 0.85, 0.88 (mean 0.91) fail on
    # their median. The probe at 3: 0.9 again.
    seeds = {1.0: [1.0, 0.9, 0.8], 2.0: [0.9, 0.9, 0.95], 4.0: [1.0, 0.85, 0.88]}
    table = _Table(lambda rate: 0.9, seeds)
    goodput = _search(table, [1.0, 2.0, 4.0], steps=1)
    assert goodput.attainment[4.0] == pytest.approx(0.88)
    assert (goodput.passing, goodput.failing, goodput.rate) == (2.0, 4.0, 3.0)


def test_bracket_of_a_non_monotone_sweep() -> None:
    # The highest passing rate, whatever failed below it; the next rate up fails.
    assert bracket({1.0: 1.0, 2.0: 0.5, 4.0: 0.95, 8.0: 0.1}) == (4.0, 8.0)
    assert bracket({1.0: 0.1}) == (None, None)
    assert bracket({1.0: 0.9, 2.0: 0.899}) == (1.0, 2.0)


def test_goodput_ratio() -> None:
    assert goodput_ratio(3.0, 2.0) == (1.5, None)
    assert goodput_ratio(0.0, 2.0) == (0.0, None)
    ratio, reason = goodput_ratio(3.0, 0.0)
    assert ratio is None and reason is not None and "colocated" in reason
    ratio, reason = goodput_ratio(0.0, 0.0)
    assert ratio is None and reason is not None and "neither" in reason


def _hand_made_sweep() -> tuple[list[SweepRun], dict[str, Goodput]]:
    runs = [
        _run(cluster, rate, seed, share)
        for cluster, shares in (("disaggregated", (1.0, 0.95, 0.5)), ("colocated", (1.0, 0.2, 0.1)))
        for rate, share in zip((1.0, 2.0, 4.0), shares, strict=True)
        for seed in (0, 1)
    ]
    runs += [_run("disaggregated", 3.0, seed, 0.4, probe=True) for seed in (0, 1)]
    goodputs = {
        "disaggregated": Goodput(2.0, "bracketed", 2.0, 4.0, 3.0, ((3.0, 0.4),)),
        "colocated": Goodput(1.0, "bracketed", 1.0, 2.0, 2.0),
    }
    return runs, goodputs


def test_document_table_and_plot_of_a_sweep(tmp_path: Path) -> None:
    runs, goodputs = _hand_made_sweep()
    document = sweep_document({"command": "sweep"}, runs, goodputs, complete=True)
    assert document["goodput_rate"] == {"disaggregated": 2.0, "colocated": 1.0}
    assert document["goodput_ratio"] == 2.0 and document["goodput_ratio_reason"] is None
    assert len(document["runs"]) == 14 and len(document["medians"]) == 7
    assert json.loads(json.dumps(document)) == document
    # Cut short after the first cluster: its goodput, no ratio, and why.
    partial = sweep_document(
        {}, runs[:6], {"disaggregated": goodputs["disaggregated"]}, complete=False
    )
    assert partial["goodput_rate"] == {"disaggregated": 2.0, "colocated": None}
    assert partial["goodput_ratio"] is None and partial["goodput_ratio_reason"]
    none = sweep_document(
        {}, runs, {**goodputs, "colocated": Goodput(0.0, "none", None, None, None)}, complete=True
    )
    assert none["goodput_ratio"] is None and "colocated" in none["goodput_ratio_reason"]

    table = format_table(runs, goodputs, SLOs(2.0, 0.1), num_seeds=2)
    lines = table.splitlines()
    assert lines[2].split()[:3] == ["1", "SLO", "attainment"]
    assert "(probe)" in table  # the disaggregated probe at 3 req/s, colocated n/a
    assert any(line.split()[:1] == ["3"] and "n/a" in line for line in lines)
    assert lines[-1].endswith("disaggregated / colocated goodput rate: 2")
    assert "TTFT <= 2 s and TPOT <= 100 ms" in table

    write_sweep_plot(tmp_path / "sweep.png", runs, goodputs)
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1,0.5", "ascending"),
        ("0.5,1,1", "twice"),
        ("0,1", "positive"),
        ("-1", "positive"),
        ("nan", "positive"),
        ("inf", "positive"),
        ("1,x", "numbers"),
    ],
)
def test_bad_rates(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_rates(text)


def test_rates_and_seeds_parse() -> None:
    assert parse_rates("0.25,0.5,2") == (0.25, 0.5, 2.0)
    assert parse_seeds("0, 1,2") == (0, 1, 2)
    for text, message in ((" ", "empty"), ("0,0", "twice"), ("a", "integers")):
        with pytest.raises(ValueError, match=message):
            parse_seeds(text)


def _sweep_argv(tmp_path: Path, *extra: str, colocated: str = "bench-colocated.yaml") -> list[str]:
    return ["bench", "sweep", "--disaggregated", str(CONFIGS / "bench-disagg.yaml"),
            "--colocated", str(CONFIGS / colocated), "--model", str(tmp_path / "absent"),
            "--rates", "0.5,1", "--num-requests", "4", "--json", str(tmp_path / "sweep.json"),
            *extra]  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--rates", "1,0.5"), "--rates must be in ascending order, got 1,0.5"),
        (("--rates", "0.5,0.5"), "--rates has a rate twice: 0.5,0.5"),
        (("--rates", "0,1"), "--rates must be positive, finite req/s, got 0"),
        (("--seeds", ","), "--seeds is empty: give at least one seed"),
        (("--ttft-slo", "0"), "--ttft-slo must be a positive number of seconds, got 0.0"),
        (("--tpot-slo", "nan"), "--tpot-slo must be a positive number of seconds, got nan"),
        (("--ttft-slo", "-1"), "--ttft-slo must be a positive number of seconds, got -1.0"),
        (("--bisect", "-1"), "--bisect must be >= 0, got -1"),
        (("--warmup", "4"), "warm-up must be in [0, 4)"),
    ],
)
def test_argument_errors_start_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: tuple[str, ...], message: str
) -> None:
    # The model directory does not exist: a cluster started would fail otherwise than this.
    assert main(_sweep_argv(tmp_path, *extra)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pdserve bench sweep: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "sweep.json").exists()


def test_config_errors_start_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_sweep_argv(tmp_path, colocated="absent.yaml")) == 2
    assert "absent.yaml" in capsys.readouterr().err
    assert main(_sweep_argv(tmp_path, colocated="bench-disagg.yaml")) == 2
    assert capsys.readouterr().err == "pdserve bench sweep: --colocated config is not colocated\n"
    assert not (tmp_path / "sweep.json").exists()
    with pytest.raises(SystemExit) as exit_info:  # argparse: a required flag missing
        main(["bench", "sweep", "--disaggregated", "d.yaml", "--rates", "1"])
    assert exit_info.value.code == 2


def _tiny_config(path: Path, model: Path, groups: dict[str, Any]) -> Path:
    raw = {
        "model": str(model),
        "dtype": "float32",
        "page_size": 16,
        "limits": {
            "max_model_len": 128,
            "max_num_seqs": 4,
            "max_num_batched_tokens": 64,
            "num_pages": 32,
        },
        "groups": groups,
        "router": {"address": "127.0.0.1:0", "http_address": "127.0.0.1:0", "grace_seconds": 2},
    }
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.slow
def test_sweep_of_two_tiny_clusters(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    disaggregated = _tiny_config(tmp_path / "d.yaml", tiny_model_dir, disaggregated_groups(1, 1))
    colocated = _tiny_config(tmp_path / "c.yaml", tiny_model_dir, mixed_groups(2))
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    argv = ["bench", "sweep", "--disaggregated", str(disaggregated), "--colocated",
            str(colocated), "--rates", "4,8", "--seeds", "0,1", "--num-requests", "2",
            "--prompt", "fixed:16", "--output", "fixed:4", "--bisect", "1",
            "--ttft-slo", "60", "--tpot-slo", "10", "--timeout", "60",
            "--json", str(out), "--plot", str(png)]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    document = json.loads(out.read_text())
    assert document["command"] == "sweep" and document["complete"]
    assert document["workload"]["rates"] == [4.0, 8.0] and document["workload"]["seeds"] == [0, 1]

    goodput = document["goodput_rate"]
    for name in ("disaggregated", "colocated"):
        mine = [run for run in document["runs"] if run["cluster"] == name]
        swept = [(run["rate"], run["seed"]) for run in mine if not run["probe"]]
        assert swept == [(4.0, 0), (4.0, 1), (8.0, 0), (8.0, 1)]
        probes = sorted({run["rate"] for run in mine if run["probe"]})
        assert len(probes) <= 1 and all(4.0 < rate < 8.0 for rate in probes)
        roles = ("prefill", "decode") if name == "disaggregated" else ("mixed",)
        for run in mine:
            metrics = run["metrics"]
            assert 0.0 <= metrics["slo_attainment"] <= 1.0
            assert run["summary"]["sent"] == 2
            # Each run's steps, from the workers' traces: its roles stepped, no other role.
            for role in ("prefill", "decode", "mixed"):
                busy = metrics[f"busy_{role}"]
                assert (0.0 < busy <= 1.0) if role in roles else busy is None
            assert metrics["decode_rows_per_step"] >= 1.0
        assert goodput[name] in {0.0, 4.0, 8.0, *probes}
        entry = document["goodput"][name]
        assert entry["rate"] == goodput[name]
        medians = [row for row in document["medians"] if row["cluster"] == name]
        assert [row["rate"] for row in medians] == sorted({4.0, 8.0, *probes})
        for row in medians:
            assert row["seeds"] == [0, 1]
            assert 0.0 <= row["metrics"]["slo_attainment"] <= 1.0
    x, y = goodput["disaggregated"], goodput["colocated"]
    if y > 0:
        assert document["goodput_ratio"] == pytest.approx(x / y)
    else:
        assert document["goodput_ratio"] is None and document["goodput_ratio_reason"]
    assert math.isfinite(float(document["goodput_ratio"] or 0.0))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The table on stdout, progress on stderr (plain lines: not a terminal).
    assert "disaggregated / colocated goodput rate" in captured.out
    assert "busy: prefill workers" in captured.out
    assert "[bench sweep] disaggregated 4 req/s seed 0: run 1 of at most 12" in captured.err
    assert "[bench sweep] colocated 8 req/s seed 1" in captured.err
