"""Helpers for engine tests: HF transformers greedy reference and an engine driver."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from workers.engine.config import EngineConfig
from workers.engine.engine_core import EngineCore
from workers.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
# Exactly three greedy tokens per request, EOS or not: finish reasons are always ``length``.
THREE_TOKENS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@functools.cache
def _hf_model(model_dir: str, device: str = "cpu") -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.to(device)  # type: ignore[arg-type]  # transformers types .to() for its own wrappers
    return model.eval()


def hf_greedy(
    model_dir: Path | str, prompt: Sequence[int], max_new_tokens: int, device: str = "cpu"
) -> list[int]:
    """HF ``generate`` (float32, ``do_sample=False``) on ``device``, stopping at the EOS."""
    model = _hf_model(str(model_dir), device)
    input_ids = torch.tensor([list(prompt)], device=device)
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=model.generation_config.pad_token_id or 0,
        )
    return out[0, len(prompt) :].tolist()


def prompts_of_lengths(lengths: Sequence[int], seed: int = 0, high: int = 256) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, high, (n,), generator=generator).tolist() for n in lengths]


def repetitive_prompts(lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a short random phrase, so prompt lookup finds what comes next (a
    random model copies such patterns often enough for drafts to be kept and rejected)."""
    phrases = prompts_of_lengths([5 + i % 4 for i in range(len(lengths))], seed=seed)
    return [
        (phrase * (n // len(phrase) + 1))[:n] for phrase, n in zip(phrases, lengths, strict=True)
    ]


def run_engine(
    engine: EngineCore,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams = GREEDY,
) -> list[list[int]]:
    """Add every prompt at once, step until done; tokens per prompt, in order."""
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
        tokens[f"r{i}"] = []
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
    engine.check_invariants()
    assert engine.block_manager.num_free_pages == engine.num_pages
    return list(tokens.values())


def drain(engine: EngineCore, max_steps: int = 500) -> dict[str, str | None]:
    """Step until nothing is unfinished; the finish reason of every request that finished.

    Fails if the engine is still busy after ``max_steps`` steps (it made no progress), and
    checks the pool's invariants at the end.
    """
    reasons: dict[str, str | None] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for output in engine.step():
            if output.finished:
                reasons[output.request_id] = output.finish_reason
    assert not engine.has_unfinished(), "engine made no progress"
    engine.check_invariants()
    return reasons


def make_engine(model_dir: Path | str, **options: Any) -> EngineCore:
    options.setdefault("num_pages", 256)
    return EngineCore(model_dir, EngineConfig(**options), detokenize=False)
