"""Tokenizers: byte-level fallback, HF tokenizer.json path, chat templates, streaming decode."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jinja2
import pytest

from workers.engine.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    Tokenizer,
    load_tokenizer,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXT = "Grüße, 世界! 🚀 naïve café"


def _stream(tokenizer: Tokenizer, prompt_ids: list[int], ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    return [detok.push(token_id) for token_id in ids]


def test_byte_tokenizer_roundtrip() -> None:
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8"))
    assert tok.decode(ids) == TEXT
    assert tok.decode([*ids[:4], 257, 300]) == TEXT[:3]
    assert tok.decode([72, 105, 257], skip_special_tokens=False) == "Hi</s>"
    assert tok.vocab_size == 259
    assert tok.eos_token_ids == (257,)


def test_incremental_detokenizer_holds_back_split_characters() -> None:
    tok = ByteTokenizer()
    prompt = tok.encode("Prompt: ")
    deltas = _stream(tok, prompt, tok.encode(TEXT))
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in delta for delta in deltas)
    # A 4-byte emoji arrives in one delta, on its last byte.
    rocket = "🚀".encode()
    emoji_deltas = _stream(tok, prompt, list(rocket))
    assert emoji_deltas == ["", "", "", "🚀"]


def test_incremental_detokenizer_flush_and_specials() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [])
    pieces = [detok.push(t) for t in [*b"ok ", 0xE4, 0xB8]]  # truncated 3-byte character
    assert "".join(pieces) == "ok "
    assert detok.flush() == "\ufffd"
    assert detok.output_text == "ok \ufffd"
    # An EOS token produces no text.
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.push(t) for t in [*b"a", 257]] == ["a", ""]


def test_load_tokenizer_falls_back_to_bytes(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [257, 258]}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, ByteTokenizer)
    assert tok.eos_token_ids == (257, 258)


def test_preset_tokenizer_json_matches_bytes_and_hf(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = load_tokenizer(tiny_model_dir)
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode(TEXT)
    assert ids == ByteTokenizer().encode(TEXT)
    assert ids == AutoTokenizer.from_pretrained(tiny_model_dir)(TEXT)["input_ids"]
    assert tok.decode(ids) == TEXT
    assert tok.bos_token_id == 256
    assert tok.eos_token_ids == (257,)
    assert tok.vocab_size == 259
    deltas = _stream(tok, tok.encode("hi "), ids)
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in delta for delta in deltas)


def test_chat_template_matches_hf(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello?"},
    ]
    tok = load_tokenizer(tiny_model_dir)
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    for add_generation_prompt in (True, False):
        ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        expected = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours == expected
    assert tok.apply_chat_template(messages).endswith("<|assistant|>\n")


# Template features of Hub checkpoints that HF's renderer supports beyond plain jinja.
HF_TEMPLATE_FEATURES = {
    "tojson-separators": "{% for m in messages %}{{ m | tojson(separators=(',', ':')) }}{% endfor %}",
    "tojson-sort-keys": "{% for m in messages %}{{ m | tojson(sort_keys=true) }}{% endfor %}",
    "tojson-ascii-indent": "{{ messages | tojson(ensure_ascii=true, indent=2) }}",
    "generation-block": (
        "{% set x = 1 %}{% for m in messages %}{% if m.role == 'assistant' %}"
        "{% generation %}{% set x = 2 %}{{ loop.index }}{{ m.content }}{{ x }}{% endgeneration %}"
        "{% else %}{{ m.content }}{% endif %}{{ x }}{% endfor %}"
    ),
}


@pytest.mark.parametrize("name", list(HF_TEMPLATE_FEATURES))
def test_chat_template_features_match_hf(tiny_model_dir: Path, name: str) -> None:
    from transformers import AutoTokenizer

    from workers.engine.tokenizer import render_chat_template

    template = HF_TEMPLATE_FEATURES[name]
    messages = [
        {"role": "system", "content": "Sé brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ]
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = hf.apply_chat_template(messages, chat_template=template, tokenize=False)
    special_tokens = load_tokenizer(tiny_model_dir).special_tokens
    assert render_chat_template(template, messages, False, special_tokens) == expected


# Variables HF passes to every chat template: tools / documents (None unless given) and the
# named special tokens of tokenizer_config.json.
VARIABLE_TEMPLATES = {
    "tools": "{% if tools is not none %}TOOLS:{{ tools | length }}{% endif %}{{ messages[0].content }}",
    "documents": "{{ bos_token }}{% if documents is not none %}DOCS{% endif %}{{ messages[0].content }}",
    "named-specials": (
        "{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ sep_token }}|{{ pad_token }}|"
        "{{ cls_token }}|{{ mask_token }}|{{ messages[0].content }}"
    ),
}


@pytest.mark.parametrize("name", list(VARIABLE_TEMPLATES))
def test_chat_template_variables_match_hf(tiny_model_dir: Path, tmp_path: Path, name: str) -> None:
    from transformers import AutoTokenizer

    from workers.engine.tokenizer import render_chat_template

    model_dir = tmp_path / "tokenizer"
    shutil.copytree(tiny_model_dir, model_dir)
    settings_path = model_dir / "tokenizer_config.json"
    settings = json.loads(settings_path.read_text())
    settings.update(sep_token="</s>", cls_token="<s>", mask_token="<pad>")
    settings_path.write_text(json.dumps(settings))

    template = VARIABLE_TEMPLATES[name]
    messages = [{"role": "user", "content": "hi"}]
    hf = AutoTokenizer.from_pretrained(model_dir)
    expected = hf.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    special_tokens = load_tokenizer(model_dir).special_tokens
    assert render_chat_template(template, messages, True, special_tokens) == expected


def test_chat_template_sources_and_helpers(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "templated"
    shutil.copytree(tiny_model_dir, model_dir)
    settings = json.loads((model_dir / "tokenizer_config.json").read_text())
    settings["chat_template"] = [
        {"name": "tool_use", "template": "TOOLS"},
        {
            "name": "default",
            "template": "{{ bos_token }}{% for m in messages %}{{ m | tojson }}{% endfor %}"
            "{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}",
        },
    ]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(settings))
    tok = load_tokenizer(model_dir)
    rendered = tok.apply_chat_template([{"role": "user", "content": "é"}])
    assert rendered == '<s>{"role": "user", "content": "é"}'
    with pytest.raises(jinja2.TemplateError, match="one message only"):
        tok.apply_chat_template([{"role": "user", "content": "a"}] * 2)
    # chat_template.jinja wins over tokenizer_config.json, as in transformers 5.
    (model_dir / "chat_template.jinja").write_text("J{{ messages[0]['content'] }}")
    assert load_tokenizer(model_dir).apply_chat_template([{"role": "user", "content": "x"}]) == "Jx"


def test_add_bos_token_setting_is_honoured(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "bos"
    shutil.copytree(tiny_model_dir, model_dir)
    settings = json.loads((model_dir / "tokenizer_config.json").read_text())
    settings["add_bos_token"] = True
    (model_dir / "tokenizer_config.json").write_text(json.dumps(settings))
    tok = load_tokenizer(model_dir)
    assert tok.encode("ab") == [256, 97, 98]
    assert tok.encode("ab", add_special_tokens=False) == [97, 98]
