"""``bench/step_overlap.py``: step times grouped by how many other workers were in a step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ["start_s", "seconds", "after_wait", "prefill_tokens", "prefill_attention",
          "decode_seqs", "decode_kv_tokens"]  # fmt: skip


def _trace(role: str, steps: list[tuple[float, float, int, int]]) -> dict[str, object]:
    records = [[start, seconds, 0, tokens, 0, rows, 0] for start, seconds, tokens, rows in steps]
    return {"role": role, "fields": FIELDS, "records": records}


def test_steps_are_grouped_by_their_busy_neighbours(tmp_path: Path) -> None:
    # The decoder's 25 steps of one row: 20 alone (1 ms), 25 beside a prefill chunk that covers
    # them whole (2 ms each): the table gives 1 ms alone and 2 ms, 2.00x, beside one neighbour.
    decode = [(float(i), 0.001, 0, 1) for i in range(20)]
    decode += [(100.0 + 0.002 * i, 0.002, 0, 1) for i in range(25)]
    prefill = [(99.0, 2.0, 256, 0)]
    document = {"runs": [{"name": "disaggregated", "step_traces": [
        _trace("decode", decode), _trace("prefill", prefill), {"worker_id": "lost"}]}]}  # fmt: skip
    path = tmp_path / "run.json"
    path.write_text(json.dumps(document))
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "step_overlap.py"), str(path)],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    assert out[1:] == [
        "run.json:disaggregated | decode | decode | 0 | 20 | 1.00 | 1.00",
        "run.json:disaggregated | decode | decode | 1 | 25 | 2.00 | 2.00",
    ]
