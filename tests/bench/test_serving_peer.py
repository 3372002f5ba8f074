"""``bench/serving.py``: pdserve and vLLM servers measured by one client. vLLM lives in a venv
of its own (``make bench-peers``) that the suite does not install, so these checks cover the
run order, the summary and the errors, up to where a server would start."""

from __future__ import annotations

import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def peers_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "bench"))


def _metrics(tpot: float, ttft: float, done: float) -> dict[str, float]:
    from peers.compare_serving import METRICS

    values = dict.fromkeys(METRICS, 0.0)
    values.update(p50_tpot_ms=tpot, p99_tpot_ms=2 * tpot, p99_ttft_ms=ttft, request_throughput=done)
    return values


def test_server_order_turns_with_every_seed(peers_on_path: None) -> None:
    from peers.compare_serving import server_order

    labels = ["a", "b", "c"]
    assert [server_order(labels, i) for i in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]


def test_medians_over_seeds_and_verdicts_against_vllm(peers_on_path: None) -> None:
    from peers.compare_serving import format_rows, medians, verdicts

    runs = []
    for seed, (ours, theirs) in enumerate([(100, 120), (300, 110), (90, 130)]):
        for rate in (0.5, 4.0):
            runs.append(
                {"workload": "w", "server": "pdserve x", "seed": seed, "rate": rate,
                 "metrics": _metrics(ours, 1000, 0.4 if rate == 4.0 else 0.5)}
            )  # fmt: skip
            runs.append(
                {"workload": "w", "server": "vllm", "seed": seed, "rate": rate,
                 "metrics": _metrics(theirs, 500, 0.6 if rate == 4.0 else 0.5)}
            )  # fmt: skip
    table = medians(runs)
    assert table[("w", "pdserve x", 0.5)]["p50_tpot_ms"] == 100  # median of 100, 300, 90
    assert table[("w", "vllm", 0.5)]["p50_tpot_ms"] == 120
    rows = verdicts(table, "vllm")
    assert [(r["server"], r["rate"]) for r in rows] == [("pdserve x", 0.5), ("pdserve x", 4.0)]
    low, top = rows
    assert low["p50_tpot_ms"]["met"] is True and low["p50_tpot_ms"]["ratio"] == 100 / 120
    assert low["p99_ttft_ms"]["met"] is False  # 1000 ms against 500
    # Completed req/s is judged at overload only: below it both complete what is offered.
    assert low["request_throughput"]["met"] is None
    assert top["request_throughput"]["met"] is False
    text = format_rows(rows)
    assert "| w | pdserve x | 0.5 | 100 / 120 = 0.83x |" in text
    assert "0.40 / 0.60 = 0.67x ✗" in text


def test_both_servers_get_the_same_client_arguments(peers_on_path: None) -> None:
    from peers.compare_serving import WORKLOADS, client_command

    common = {
        "port": 8400,
        "model_dir": Path("/m/SmolLM2"),
        "model_name": "SmolLM2",
        "workload": WORKLOADS["random-256-64"],
        "rate": 0.6,
        "num_prompts": 60,
        "seed": 3,
    }
    command = client_command(Path("/venv/bin/python"), Path("/out/r.json"), **common)  # type: ignore[arg-type]
    rest = command[command.index("--") + 1 :]
    pairs = dict(pairwise(rest))
    assert pairs["--random-input-len"] == "256" and pairs["--random-output-len"] == "64"
    assert pairs["--request-rate"] == "0.6" and pairs["--seed"] == "3"
    assert pairs["--temperature"] == "0"  # greedy on both servers
    assert "--ignore-eos" in rest and pairs["--endpoint"] == "/v1/completions"


def test_each_rate_of_a_seed_sends_prompts_of_its_own(peers_on_path: None) -> None:
    # One server serves a seed's rates in turn: a repeated prompt list would be answered from
    # its prefix cache.
    from peers.compare_serving import client_seed

    for seed in (0, 3, 999):
        seeds = [client_seed(seed, i) for i in range(10)]
        assert len(set(seeds)) == 10
        assert seeds[0] == seed  # a one-rate run is the run it always was


def test_a_missing_vllm_venv_is_one_line_naming_make_bench_peers(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "serving.py")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"VLLM_VENV": str(tmp_path / "none"), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: no vLLM venv at {tmp_path / 'none'}: run `make bench-peers` first"
    ]


def test_an_unknown_workload_is_refused(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "serving.py"), "--workloads", "nope"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 2
    assert "--workloads: unknown 'nope'" in result.stderr


# A parent in a session of its own (as `running` starts a server) starts a child that spins
# ~0.4 s of CPU under a name of its own; both wait for a line on stdin before they exit.
_TREE = r"""
import os, subprocess, sys
os.setsid()
child = subprocess.Popen([sys.executable, "-c", '''
import ctypes, sys, time
ctypes.CDLL(None).prctl(15, b"pd-spinner", 0, 0, 0)  # PR_SET_NAME: the name /proc shows
end = time.process_time() + 0.4
while time.process_time() < end:
    pass
print("spun", flush=True)
sys.stdin.readline()
'''], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
print(child.stdout.readline().strip(), flush=True)
sys.stdin.readline()
child.communicate("\n")
"""


def test_server_cores_count_each_process_of_the_tree_by_name(peers_on_path: None) -> None:
    from peers.process_cpu import TreeSampler, cores_used, format_cores, tree_cpu_seconds

    before = {"pd-spinner": 0.0}
    tree = subprocess.Popen(
        [sys.executable, "-c", _TREE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        with TreeSampler(tree.pid, period_s=0.05) as sampler:
            assert tree.stdout is not None and tree.stdout.readline().strip() == "spun"
        # The spin happened within the sampled span: the spinner took a share of a core.
        assert 0 < sampler.cores_over(3600.0)["pd-spinner"] <= 1.0
        after = tree_cpu_seconds(tree.pid)
        parent = Path(f"/proc/{tree.pid}/comm").read_text().strip()
        assert set(after) == {parent, "pd-spinner"}  # the tree only, not this test's process
        assert after["pd-spinner"] >= 0.35  # the grandchild's CPU, by its own name
        assert after[parent] < 10  # the parent's own (a long test run's process has more)
        cores = cores_used(before, after, 2.0)
        assert cores["pd-spinner"] == pytest.approx(after["pd-spinner"] / 2.0, abs=1e-3)
        assert next(iter(cores)) == "pd-spinner"  # largest first
        assert format_cores(cores, top=1).startswith("pd-spinner 0.")
    finally:
        assert tree.stdin is not None
        tree.stdin.write("\n")
        tree.stdin.close()
        tree.wait(30)
    with pytest.raises(ValueError, match="wall_s must be positive"):
        cores_used(before, before, 0.0)
