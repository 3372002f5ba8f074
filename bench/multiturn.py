"""Prefix caching and KV-aware routing on multi-turn chat, on the 1 prefill : 3 decode cluster.

    python bench/multiturn.py [--config configs/local-1p3d.yaml] [--seeds 0,1,2]
        [--variants off,on,kv_aware] [--prompt multiturn:8:5] [--system-tokens 256]
        [--question-tokens 32-64] [--output-tokens 32] [--rate 0.5]
        [--json bench/out/multiturn.json]

Variants of the one config, each started alone (embedded Ray), the same conversations for a
seed (`pdserve bench multiturn`'s workload): ``off`` (no prefix caching, the config's policy),
``on`` (caching on both groups, least_outstanding routing), ``kv_aware`` (caching, the
``kv_aware`` router). Per run, from the client: TTFT p50 / p99 over all turns and over turns
>= 2; from the workers (their counters at the end): prompt tokens computed (prefill and
decoders) against prompt tokens sent, and the decoders' KV pages written by the prefill worker
against those found in their own cache; bytes = pages x page_size x the model's KV bytes per
token (what crossed the fabric, every layer), split into turn 1 and turns >= 2 with each
request's transfer record. Medians over seeds, and each variant's ratio to ``off``. Progress
on stderr; the table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orchestrator.config.cluster import ClusterConfig  # noqa: E402
from orchestrator.config.yaml_file import read_yaml  # noqa: E402
from orchestrator.loadgen.compare import serving  # noqa: E402
from orchestrator.loadgen.conversations import (  # noqa: E402
    measure_conversations,
    parse_multiturn,
)
from orchestrator.loadgen.report import machine_load  # noqa: E402
from orchestrator.loadgen.stats import SLOs  # noqa: E402
from orchestrator.sim.conversations import MultiTurnWorkload  # noqa: E402
from workers.engine.model_config import ModelConfig  # noqa: E402
from workers.log import echo  # noqa: E402

VARIANTS = ("off", "on", "kv_aware")


def variant_config(path: Path, variant: str) -> ClusterConfig:
    raw = read_yaml(path)
    assert isinstance(raw, dict)
    caching = variant != "off"
    for group in raw["groups"].values():
        group.setdefault("limits", {})["enable_prefix_caching"] = caching
    raw["router"]["policy"] = "kv_aware" if variant == "kv_aware" else "least_outstanding"
    raw["router"]["address"] = "127.0.0.1:0"
    raw["router"]["http_address"] = None
    return ClusterConfig.from_dict(raw, base_dir=path.parent)


async def one_run(config: ClusterConfig, shape: MultiTurnWorkload, variant: str) -> dict[str, Any]:
    slos = SLOs(ttft_s=2.0, tpot_s=0.1)
    async with serving(variant, config) as (app, address, _):
        turns, summary = await measure_conversations(address, shape, slos)
        states: dict[str, dict[str, Any]] = {}
        records: dict[str, dict[str, Any]] = {}
        ids = [f"bench-{t.result.index}" for t in turns]
        for record in app.controller.registry.workers.values():
            handle = app.controller.handle_of(record.worker_id)
            states[record.worker_id] = {"role": record.role, **await handle.state.remote()}
            if record.role == "decode":
                records.update(await handle.transfer_stats.remote(ids))
    model = ModelConfig.from_dir(config.model)
    page_bytes = model.kv_page_bytes(config.page_size, 4 if config.dtype == "float32" else 2)
    turn_of = {f"bench-{t.result.index}": t.turn for t in turns}
    later_pages = sum(len(r["page_ids"]) for rid, r in records.items() if turn_of.get(rid, 0) > 0)
    decoders = [s for s in states.values() if s["role"] == "decode"]
    written = sum(s["num_kv_pages_written"] for s in decoders)
    return {
        "variant": variant,
        "summary": summary,
        "workers": states,
        "prompt_tokens_sent": summary["prompt_tokens_sent"],
        "prompt_tokens_computed": sum(s["num_computed_prompt_tokens"] for s in states.values()),
        "pages_written": written,
        "pages_skipped": sum(s["num_kv_pages_skipped"] for s in decoders),
        "bytes": written * page_bytes,
        "bytes_later_turns": later_pages * page_bytes,
        "ttft_p50_s": summary["ttft_s"]["p50"],
        "ttft_p99_s": summary["ttft_s"]["p99"],
        "ttft_later_p50_s": summary["ttft_later_turns_s"]["p50"],
        "errored": summary["errored"] + summary["not_sent"],
    }


# (label, key, scale, format)
FIGURES = (
    ("TTFT p50 ms", "ttft_p50_s", 1000.0, ".0f"),
    ("TTFT p99 ms", "ttft_p99_s", 1000.0, ".0f"),
    ("TTFT p50 turns>=2 ms", "ttft_later_p50_s", 1000.0, ".0f"),
    ("ITL p99 ms", "itl_p99_s", 1000.0, ".0f"),
    ("TPOT mean ms", "tpot_mean_s", 1000.0, ".0f"),
    ("prompt computed / sent", "computed_share", 1.0, ".2f"),
    ("pages written", "pages_written", 1.0, ".0f"),
    ("pages skipped", "pages_skipped", 1.0, ".0f"),
    ("MiB turns>=2", "bytes_later_turns", 1 / 2**20, ".1f"),
)


def medians(runs: list[dict[str, Any]], variants: list[str]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for variant in variants:
        mine = [r for r in runs if r["variant"] == variant]
        for run in mine:
            run["computed_share"] = run["prompt_tokens_computed"] / run["prompt_tokens_sent"]
            run["itl_p99_s"] = run["summary"]["itl_s"]["p99"]
            run["tpot_mean_s"] = run["summary"]["tpot_s"]["mean"]
        out[variant] = {
            key: statistics.median(r[key] for r in mine) for _, key, _, _ in FIGURES if mine
        }
    return out


def table(result: dict[str, dict[str, float]], variants: list[str]) -> str:
    lines = [f"{'median over seeds':<24}" + "".join(f"{v:>14}" for v in variants)]
    for label, key, scale, form in FIGURES:
        cells = []
        for variant in variants:
            value = result[variant][key] * scale
            base = result.get("off", {}).get(key)
            ratio = (
                f" {result[variant][key] / base:.2f}x"
                if base and variant != "off" and key != "computed_share"
                else ""
            )
            cells.append(f"{value:{form}}{ratio}".rjust(14))
        lines.append(f"{label:<24}" + "".join(cells))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "local-1p3d.yaml")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--prompt", default="multiturn:8:5")
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--question-tokens", default="32-64")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--rate", type=float, default=0.5, help="conversations per second")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "multiturn.json")
    parser.add_argument(
        "--from-json", type=Path, default=None, help="print the table of a saved run; run nothing"
    )
    args = parser.parse_args()
    variants = args.variants.split(",")
    if not set(variants) <= set(VARIANTS):
        parser.error(f"--variants: of {VARIANTS}")
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())["runs"]
        variants = [v for v in VARIANTS if any(r["variant"] == v for r in saved)]
        print(table(medians(saved, variants), variants))
        return 0
    low, _, high = args.question_tokens.partition("-")
    runs = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        shape = parse_multiturn(
            args.prompt,
            system_tokens=args.system_tokens,
            question_tokens=(int(low), int(high or low)),
            output_tokens=args.output_tokens,
            rate=args.rate,
            seed=seed,
        )
        for variant in variants:
            echo(f"seed {seed}, {variant}: load {machine_load()}")
            run = asyncio.run(one_run(variant_config(args.config, variant), shape, variant))
            run["seed"] = seed
            runs.append(run)
            echo(
                f"   TTFT p50 {run['ttft_p50_s']:.3f} s, computed {run['prompt_tokens_computed']}"
                f" of {run['prompt_tokens_sent']} prompt tokens, pages written "
                f"{run['pages_written']} skipped {run['pages_skipped']}, errors {run['errored']}"
            )
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"argv": sys.argv, "runs": runs}, indent=2))
    result = medians(runs, variants)
    print(table(result, variants))
    args.json.write_text(json.dumps({"argv": sys.argv, "runs": runs, "medians": result}, indent=2))
    return 0 if all(r["errored"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
