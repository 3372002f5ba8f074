"""``bench/memory.py``: an engine's memory as it prefills prompts of many lengths, and the
``/proc`` reading its cluster mode prints for each worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import memory  # noqa: E402  (bench/ is not a package)


def test_engine_mode_reports_memory_every_few_prompts(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "memory.json"
    argv = [sys.executable, str(ROOT / "bench" / "memory.py"), "engine", "--model",
            str(tiny_model_dir), "--prompts", "5", "--every", "2", "--prompt", "uniform:20-60",
            "--max-num-batched-tokens", "64", "--json", str(out)]  # fmt: skip
    printed = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    rows = json.loads(out.read_text())
    assert [row["prompts"] for row in rows] == [0, 2, 4, 5]  # and the last
    assert all(row["rss_mb"] > 0 and row["in_use_mb"] > 0 for row in rows)
    assert printed.splitlines()[-1].startswith("prompts 5 seconds ")


def test_process_memory_reads_this_process() -> None:
    found = memory.process_memory(os.getpid())
    assert found is not None and found["pid"] == os.getpid()
    assert found["rss_mb"] > 10 and found["cpu_s"] > 0 and found["nice"] == os.nice(0)
    assert memory.process_memory(2**22 + 1) is None  # above pid_max: no such process
