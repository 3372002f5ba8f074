"""vLLM's own serving benchmark client (``vllm.benchmarks.serve``), run in vLLM's venv against
any OpenAI-compatible server: the same client measures ``pdserve serve`` and ``vllm serve``.

    python bench/peers/vllm_client.py --result OUT.json -- <vllm bench serve arguments>

Writes vLLM's result dictionary (its ``--save-result`` JSON) to OUT.json. Not imported by
pdserve: this file runs under vLLM's interpreter (``make bench-peers`` makes the venv).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path


def main() -> None:
    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument("--result", type=Path, required=True)
    known, rest = ours.parse_known_args()
    if rest and rest[0] == "--":
        rest = rest[1:]
    from vllm.benchmarks import serve  # vLLM's venv only

    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    with tempfile.TemporaryDirectory() as out:
        args = parser.parse_args(
            [*rest, "--save-result", "--result-dir", out, "--result-filename", "result.json"]
        )
        serve.main(args)
        known.result.parent.mkdir(parents=True, exist_ok=True)
        os.replace(Path(out) / "result.json", known.result)
    print(f"result: {known.result}", file=sys.stderr)


if __name__ == "__main__":
    main()
