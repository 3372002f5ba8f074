"""Speculative decoding benchmark: decode with and without drafts, in one run, same prompts.

    .venv/bin/python bench/spec.py [--model DIR] [--batches 1,8] [--repeats 3] [--new-tokens 96]
                                   [--k 3] [--threads N] [--preset deepseek-tiny]
                                   [--workload extractive|open] [--method ngram|mtp]

Workloads (``--workload``): ``extractive`` (answers that copy the prompt, where prompt lookup
pays): eight short passages, each asked back with a chat-templated instruction to quote it /
list its sentences / rewrite it with one change; ``open``: eight open-ended asks ("write a short
story about ..."), whose answers copy little, to show where drafts do not pay. SmolLM2-135M-Instruct (the demo checkpoint) by default; with
``--preset deepseek-tiny`` a random-weight DeepSeek-V3-style model instead (its acceptance
says little: random weights copy little).

For each batch size the engine with drafts (``--method``: ``ngram``, ``--k`` a step, or a DeepSeek
preset's ``mtp`` module, one a step) and without take turns,
A B A B, ``--repeats`` times; greedy, ``max_tokens`` ``--new-tokens``, EOS honoured. Reported:
output tokens / second over the whole batch (prefill included, the same for both), the best of
the repeats; the ratio; the share of drafts kept; tokens per sequence per step (an estimate: the
batch's last sequences run alone); and whether the outputs
were identical (greedy speculation must not change a token).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.engine.llm import LLM
from workers.engine.sampling_params import SamplingParams
from workers.log import configure_logging

PASSAGES = [
    "The lighthouse at the end of the pier was built in 1887. Its lamp burned whale oil until "
    "1910, when the harbour board replaced it with an electric light. The keeper's cottage is "
    "now a small museum that opens on weekends from April to October.",
    "To reset the router, hold the recessed button on the back for ten seconds until the "
    "status light blinks amber. Release it, wait two minutes, and connect to the network named "
    "on the label. The default password is printed under the barcode.",
    "Our quarterly revenue rose by twelve percent, driven mostly by subscriptions in Europe. "
    "Hardware sales fell slightly, and operating costs stayed flat. The board approved a "
    "dividend of forty cents per share, payable on the first of March.",
    "Mix two cups of flour with a teaspoon of salt. Add one cup of warm water and knead the "
    "dough for ten minutes. Let it rest under a damp cloth for an hour, then roll it thin and "
    "bake it on a hot stone until it puffs up.",
    "The meeting on Tuesday covered three topics: the migration of the billing database, the "
    "new on-call rotation, and the budget for the spring conference. The migration is planned "
    "for the weekend of the twelfth; the rotation starts next Monday.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It happens in "
    "the chloroplasts of plant cells, where chlorophyll absorbs mostly red and blue light and "
    "reflects green, which is why leaves look green to us.",
    "Please return the signed lease by Friday. The deposit of nine hundred dollars is due with "
    "the first month's rent. Pets are allowed with written permission, and parking space "
    "number fourteen is assigned to your unit.",
    "The river rises in the northern hills and flows south for two hundred kilometres before it "
    "reaches the sea. Three towns stand on its banks, and a ferry still crosses it at the old "
    "market town, where no bridge was ever built.",
]
# Open-ended asks, where the answer copies little of the prompt: where ngram should not pay.
OPEN_TOPICS = [
    "a lighthouse keeper",
    "resetting a home router",
    "a company's quarterly results",
    "baking flatbread",
    "a team meeting",
    "how plants make sugar",
    "renting an apartment",
    "a river town",
]
INSTRUCTIONS = [
    "Repeat the following text exactly, word for word:",
    "List every sentence of this text on its own line, unchanged:",
    "Copy this text, but write every number in digits:",
    "Quote the text below in full, then say in one line what it is about:",
]


def chat_prompts(llm: LLM, workload: str) -> list[Any]:
    tokenizer = llm.tokenizer
    prompts: list[Any] = []
    for i, passage in enumerate(PASSAGES):
        if workload == "extractive":
            message = f"{INSTRUCTIONS[i % len(INSTRUCTIONS)]}\n\n{passage}"
        else:
            message = f"Write a short story about {OPEN_TOPICS[i]}."
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": message}]))
        else:
            prompts.append(message)
    return prompts


def run(llm: LLM, prompts: list[Any], batch: int, params: SamplingParams) -> tuple[float, list]:
    """Seconds to generate every prompt's answer, ``batch`` prompts at a time; the outputs."""
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for first in range(0, len(prompts), batch):
        results = llm.generate(prompts[first : first + batch], params)
        outputs.extend(result.token_ids for result in results)
    return time.perf_counter() - start, outputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint dir (default: SmolLM2 demo)")
    parser.add_argument("--preset", choices=["deepseek-tiny"], default=None)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=3, help="draft tokens a step (ngram)")
    parser.add_argument(
        "--method", choices=["ngram", "mtp"], default="ngram", help="mtp: DeepSeek presets only"
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--workload", choices=["extractive", "open"], default="extractive", help="prompt mix"
    )
    args = parser.parse_args()
    configure_logging(default=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as root:
        if args.preset:
            from workers.engine.presets import write_random_checkpoint

            model_dir = write_random_checkpoint(args.preset, Path(root) / args.preset)
            label = f"preset {args.preset} (random init)"
        elif args.model:
            model_dir, label = Path(args.model), args.model
        else:
            from workers.engine.demo_model import fetch_demo_model

            model_dir = fetch_demo_model(None)
            label = model_dir.name
        k = 1 if args.method == "mtp" else args.k
        spec = {"method": args.method, "num_speculative_tokens": k}
        plain = LLM(model_dir, num_pages=512, detokenize=False)
        fast = LLM(model_dir, num_pages=512, detokenize=False, speculative_config=spec)
        prompts = chat_prompts(plain, args.workload)
        params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens)
        print(f"# model {label}, float32, {torch.get_num_threads()} threads; {args.method} k={k}")
        print(
            f"# {len(prompts)} {args.workload} prompts, up to {args.new_tokens} new tokens, greedy"
        )
        print(
            "| batch | plain tok/s | speculative tok/s | ratio | drafts kept | tokens / sequence / step "
            "| identical outputs |"
        )
        print("|---|---|---|---|---|---|---|")
        for batch in (int(b) for b in args.batches.split(",")):
            run(plain, prompts[:batch], batch, params)  # warm-up
            run(fast, prompts[:batch], batch, params)
            best = {"plain": float("inf"), "spec": float("inf")}
            outputs: dict[str, list] = {}
            stats = fast.engine.stats
            drafts0, kept0 = stats.num_draft_tokens, stats.num_accepted_tokens
            sampled0, steps0 = stats.num_sampled_tokens, stats.num_steps
            for _ in range(args.repeats):
                for name, llm in (("plain", plain), ("spec", fast)):
                    seconds, outputs[name] = run(llm, prompts, batch, params)
                    best[name] = min(best[name], seconds)
                    print(f"  batch {batch} {name}: {seconds:.2f} s", file=sys.stderr)
            tokens = sum(len(o) for o in outputs["plain"])
            drafts = stats.num_draft_tokens - drafts0
            kept = stats.num_accepted_tokens - kept0
            steps = max(1, stats.num_steps - steps0)
            per_step = (stats.num_sampled_tokens - sampled0) / steps / min(batch, len(prompts))
            print(
                f"| {batch} | {tokens / best['plain']:.1f} | {tokens / best['spec']:.1f} "
                f"| {best['plain'] / best['spec']:.2f}x | {kept / max(1, drafts):.0%} "
                f"| {per_step:.2f} | {'yes' if outputs['plain'] == outputs['spec'] else 'NO'} |"
            )
        plain.close()
        fast.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
