"""The offline SmolLM2-135M-Instruct checkpoint: conversion, HF parity, a factual answer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.engine.model_helpers import PagedRunner, hf_logits
from workers.engine.demo_model import fetch_demo_model, is_complete
from workers.engine.loader import load_model
from workers.engine.tokenizer import HFTokenizer, IncrementalDetokenizer, load_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def test_checkpoint_is_complete_and_cached(demo_model_dir: Path) -> None:
    assert is_complete(demo_model_dir)
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (demo_model_dir / name).is_file(), name
    stamp = (demo_model_dir / "model.safetensors").stat().st_mtime_ns
    assert fetch_demo_model(demo_model_dir) == demo_model_dir
    assert (demo_model_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_tokenizer_config_reads_in_transformers_4(demo_model_dir: Path) -> None:
    """Servers pinned to transformers 4 (vLLM's CPU builds among them) load the checkpoint: the
    tokenizer class is one transformers 4 knows and the chat template is in the config too."""
    settings = json.loads((demo_model_dir / "tokenizer_config.json").read_text())
    assert settings["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert settings["chat_template"].startswith("{% for message in messages %}")


def test_logits_match_hf(demo_model_dir: Path) -> None:
    tokenizer = load_tokenizer(demo_model_dir)
    ids = tokenizer.encode("Paged attention keeps the KV cache in fixed-size pages.")
    model, config = load_model(demo_model_dir)
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (30, 9, 3)
    [ours] = PagedRunner(model, config, num_pages=8).step([(0, ids)])
    expected = hf_logits(demo_model_dir, ids)
    torch.testing.assert_close(ours, expected, atol=2e-3, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def test_greedy_answer_names_paris(demo_model_dir: Path) -> None:
    tokenizer = load_tokenizer(demo_model_dir)
    model, config = load_model(demo_model_dir)
    runner = PagedRunner(model, config, num_pages=8)
    prompt = tokenizer.encode(PROMPT)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    [logits] = runner.step([(0, prompt)])
    text = ""
    for _ in range(6):
        token = int(logits[-1].argmax())
        if token in tokenizer.eos_token_ids:
            break
        text += detok.push(token)
        [logits] = runner.step([(0, [token])])
    assert "Paris" in text, text


def test_hf_answers_paris_from_the_converted_checkpoint(demo_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


def test_tokenizer_and_chat_template_match_hf(demo_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours = load_tokenizer(demo_model_dir)
    assert isinstance(ours, HFTokenizer)
    hf = AutoTokenizer.from_pretrained(demo_model_dir)
    text = "Grüße aus Köln — 東京 🚀 costs €5"
    ids = ours.encode(text)
    assert ids == hf(text)["input_ids"]
    assert ours.decode(ids) == text
    assert 2 in ours.eos_token_ids
    detok = IncrementalDetokenizer(ours, ours.encode("Say: "))
    deltas = [detok.push(token_id) for token_id in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected
