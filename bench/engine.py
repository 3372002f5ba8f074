"""Engine benchmark: pdserve's engine against HF transformers ``generate`` on one checkpoint.

    .venv/bin/python bench/engine.py [--model DIR] [--new-tokens 32] [--repeats 3] [--threads N]
                                     [--dtype float32|bfloat16] [--batches 1,16,64]

Measures, in one process with the same torch thread settings for both:
- prefill tokens/s for one 512-token prompt (time to the first token);
- decode tokens/s at batch 1, 16 and 64: prompts of 32 tokens, ``--new-tokens`` new tokens each
  (greedy, EOS ignored); decode time = time to generate all tokens minus time to the first.
Each figure is the best of ``--repeats`` runs after a warm-up. ``--dtype`` sets the weight and
compute dtype of both engines (bfloat16 is what serving deployments run; on CPUs with AMX its GEMMs
are several times faster than float32, so per-step overhead weighs more).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from workers.engine.config import EngineConfig
from workers.engine.engine_core import EngineCore
from workers.engine.sampling_params import SamplingParams

PREFILL_LEN = 512
DECODE_PROMPT_LEN = 32
BATCH_SIZES = (1, 16, 64)


def best_of(repeats: int, run: Callable[[], float]) -> float:
    run()  # warm-up
    return min(run() for _ in range(repeats))


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=generator).tolist()


# --- pdserve -------------------------------------------------------------------------------


def engine_run(
    engine: EngineCore, prompts: list[list[int]], new_tokens: int
) -> tuple[float, float]:
    """(seconds to the first token of every request, seconds for the rest)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{i}", prompt, params)
    first_done: float | None = None
    started: set[str] = set()
    while engine.has_unfinished():
        for output in engine.step():
            if output.new_token_ids:
                started.add(output.request_id)
        if first_done is None and len(started) == len(prompts):
            first_done = time.perf_counter()
    end = time.perf_counter()
    assert first_done is not None
    return first_done - start, end - first_done


# --- HF transformers -----------------------------------------------------------------------


def hf_run(model: Any, prompts: list[list[int]], new_tokens: int) -> float:
    input_ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    assert out.shape[1] == input_ids.shape[1] + new_tokens
    return time.perf_counter() - start


# --- main ----------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the small preset)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--batches", default=",".join(map(str, BATCH_SIZES)), help="decode batch sizes"
    )
    args = parser.parse_args()
    batches = tuple(int(b) for b in args.batches.split(","))
    if args.threads:
        # On shared machines extra OpenMP threads spin against other processes; one thread
        # gives stable figures.
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)

    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from workers.engine.presets import write_random_checkpoint

            model_dir = write_random_checkpoint("small", Path(tmp) / "small")
            label = "preset small (random init)"
        else:
            model_dir = Path(args.model)
            label = str(model_dir)
        rows = measure(model_dir, args.new_tokens, args.repeats, args.dtype, batches)

    print(
        f"\nmodel: {label}, {args.dtype}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"decode: {DECODE_PROMPT_LEN}-token prompts, {args.new_tokens} new tokens, greedy\n")
    print(f"| {'metric':<28} | {'pdserve':>10} | {'HF':>10} | {'ratio':>6} |")
    print(f"|{'-' * 30}|{'-' * 12}|{'-' * 12}|{'-' * 8}|")
    for name, ours, theirs in rows:
        print(f"| {name:<28} | {ours:>10.1f} | {theirs:>10.1f} | {ours / theirs:>5.2f}x |")
    return 0


def measure(
    model_dir: Path,
    new_tokens: int,
    repeats: int,
    dtype: str = "float32",
    batches: tuple[int, ...] = BATCH_SIZES,
) -> list[tuple[str, float, float]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    vocab = min(int(hf.config.vocab_size), 256 if hf.config.vocab_size < 1000 else 10**9)
    max_batch = max(batches)
    config = EngineConfig(
        dtype=dtype,
        num_pages=max_batch * -(-(DECODE_PROMPT_LEN + new_tokens) // 16) + 64,
        max_num_seqs=max_batch,
        max_num_batched_tokens=max(PREFILL_LEN, max_batch * DECODE_PROMPT_LEN),
    )
    engine = EngineCore(model_dir, config, detokenize=False)
    rows = []

    prompt = random_prompts(1, PREFILL_LEN, vocab, seed=0)
    ours = best_of(repeats, lambda: engine_run(engine, prompt, 1)[0])
    theirs = best_of(repeats, lambda: hf_run(hf, prompt, 1))
    rows.append((f"prefill {PREFILL_LEN} tok/s", PREFILL_LEN / ours, PREFILL_LEN / theirs))
    print(f"prefill: pdserve {ours * 1000:.0f} ms, HF {theirs * 1000:.0f} ms", flush=True)

    for batch in batches:
        prompts = random_prompts(batch, DECODE_PROMPT_LEN, vocab, seed=batch)
        decoded = batch * (new_tokens - 1)
        ours = best_of(repeats, partial(lambda p: engine_run(engine, p, new_tokens)[1], prompts))
        hf_first = best_of(repeats, partial(hf_run, hf, prompts, 1))
        hf_all = best_of(repeats, partial(hf_run, hf, prompts, new_tokens))
        theirs = max(hf_all - hf_first, 1e-9)
        rows.append((f"decode batch {batch} tok/s", decoded / ours, decoded / theirs))
        print(f"decode batch {batch}: pdserve {ours:.2f} s, HF {theirs:.2f} s", flush=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
