"""``pdserve demo`` / ``make demo``: the engine alone answers a few chat prompts as one batch."""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

logger = logging.getLogger(__name__)

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Write a haiku about the ocean.",
    "Explain in two sentences what a CPU does.",
    "What is 12 times 7?",
]


def run_demo(model_dir: str | None, max_tokens: int) -> int:
    from workers.engine import LLM, SamplingParams

    started = time.perf_counter()
    if model_dir is None:
        from workers.engine.demo_model import fetch_demo_model

        print("fetching SmolLM2-135M-Instruct (converted once, then cached) ...", flush=True)
        path = fetch_demo_model(None)
    else:
        path = Path(model_dir)
    print(f"loading {path} ...", flush=True)
    llm = LLM(path, max_num_seqs=len(QUESTIONS))
    print(f"ready in {time.perf_counter() - started:.1f} s", flush=True)

    tokenizer = llm.tokenizer
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": q}]),
            add_special_tokens=False,
        )
        for q in QUESTIONS
    ]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    print(f"answering {len(prompts)} prompts as one concurrent batch ...\n", flush=True)
    batch_started = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - batch_started

    for question, result in zip(QUESTIONS, results, strict=True):
        ttft = result.ttft or 0.0
        itl = result.mean_inter_token_latency
        itl_text = f"{itl * 1000:.1f} ms" if itl is not None else "n/a"
        print(f"Q: {question}")
        print(f"A: {result.text.strip()}")
        print(
            f"   [{len(result.prompt_token_ids)} prompt tokens, {len(result.token_ids)} new, "
            f"finish={result.finish_reason}, TTFT {ttft * 1000:.0f} ms, "
            f"inter-token {itl_text}]\n"
        )
    num_new = sum(len(r.token_ids) for r in results)
    num_prompt = sum(len(r.prompt_token_ids) for r in results)
    itls = [r.mean_inter_token_latency for r in results if r.mean_inter_token_latency is not None]
    print(
        f"total: {len(results)} requests, {num_prompt} prompt + {num_new} generated tokens in "
        f"{elapsed:.2f} s -> {num_new / elapsed:.1f} generated tokens/s; "
        f"mean TTFT {statistics.mean((r.ttft or 0.0) for r in results) * 1000:.0f} ms, "
        f"mean inter-token {statistics.mean(itls) * 1000 if itls else 0.0:.1f} ms"
    )
    return 0
