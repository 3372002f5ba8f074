"""Tokenizers of a checkpoint directory, chat templates, and streaming detokenization.

`load_tokenizer` returns an `HFTokenizer` (HF ``tokenizers`` over ``tokenizer.json``) when the
checkpoint has one, else a `ByteTokenizer` (token id b = byte b). Chat templates are rendered
with jinja2 in a sandbox like HF ``apply_chat_template``; the rendered prompt already contains
any BOS the template wants, so encode it with ``add_special_tokens=False``.
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

logger = logging.getLogger(__name__)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (what ByteLevel uses)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# Its reverse (`HFTokenizer.token_bytes`).
_GPT2_BYTE_OF = {char: byte for byte, char in bytes_to_unicode().items()}

# Used when a checkpoint has no template of its own (random presets, byte-level fallback).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


class Tokenizer(ABC):
    """What the engine and router need from a tokenizer."""

    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    chat_template: str
    special_tokens: dict[str, str]  # e.g. {"bos_token": "<s>", "eos_token": "</s>"}

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Entries the tokenizer knows (may be fewer than the model's embedding rows)."""

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ids the tokenizer does not know decode to nothing."""

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt, self.special_tokens
        )

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """Each token's own bytes (OpenAI's logprobs ``bytes``, which a client joins to rebuild
        a character split over tokens; `decode` of such a token alone gives U+FFFD). Here: its
        decoded text; tokenizers that know their tokens' bytes say so."""
        return [self.decode([token_id], skip_special_tokens=False).encode() for token_id in ids]


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF's signature: templates on the Hub pass these options, and expect non-ASCII kept as is
    # (jinja's own tojson would also escape HTML characters).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body unchanged.

    HF templates mark the assistant's part with it (HF can report where it is, for training
    masks); rendering a prompt needs only the text.
    """

    tags = {"generation"}  # noqa: RUF012 - jinja2.ext.Extension declares it a plain set

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def render_chat_template(
    template: str,
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
    special_tokens: dict[str, str],
) -> str:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    # HF always defines ``tools`` and ``documents`` (None without any): templates test
    # ``tools is not none``, which an undefined name passes.
    return env.from_string(template).render(
        messages=messages,
        tools=None,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **special_tokens,
    )


class ByteTokenizer(Tokenizer):
    """Token id b is byte b of the UTF-8 text; then ``<s>``, ``</s>``, ``<pad>`` (256..258).

    Matches the ``tokenizer.json`` that `presets` writes, for checkpoints without tokenizer files.
    """

    NUM_BYTES = 256
    SPECIALS = ("<s>", "</s>", "<pad>")

    def __init__(self, eos_token_ids: tuple[int, ...] = (257,), bos_token_id: int = 256) -> None:
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.chat_template = DEFAULT_CHAT_TEMPLATE
        self.special_tokens = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}

    @property
    def vocab_size(self) -> int:
        return self.NUM_BYTES + len(self.SPECIALS)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # Like the preset tokenizer.json: no BOS is added even with add_special_tokens.
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        parts: list[str] = []
        pending = bytearray()
        for token_id in ids:
            if 0 <= token_id < self.NUM_BYTES:
                pending.append(token_id)
                continue
            special = token_id - self.NUM_BYTES
            if not skip_special_tokens and 0 <= special < len(self.SPECIALS):
                parts.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
                parts.append(self.SPECIALS[special])
        parts.append(pending.decode("utf-8", errors="replace"))
        return "".join(parts)

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        # A byte token is its byte; a special token its text.
        return [
            bytes([token_id])
            if 0 <= token_id < self.NUM_BYTES
            else self.decode([token_id], skip_special_tokens=False).encode()
            for token_id in ids
        ]


# The named special tokens HF passes to chat templates (``special_tokens_map``).
_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class HFTokenizer(Tokenizer):
    """HF ``tokenizers`` backend plus the settings of ``tokenizer_config.json``."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer as RawTokenizer
        from tokenizers import decoders

        self._tokenizer = RawTokenizer.from_file(str(model_dir / "tokenizer.json"))
        # For `token_bytes`: whether pieces are GPT-2 byte characters, and the added tokens.
        self._byte_level = isinstance(self._tokenizer.decoder, decoders.ByteLevel)
        self._added_ids = frozenset(self._tokenizer.get_added_tokens_decoder())
        settings = _read_json(model_dir / "tokenizer_config.json")
        self.special_tokens = {
            key: text
            for key in _SPECIAL_TOKEN_KEYS
            if (text := _token_text(settings.get(key))) is not None
        }
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id = self._tokenizer.token_to_id(bos) if bos else None
        self._add_bos = bool(settings.get("add_bos_token", False))
        self.eos_token_ids = self._eos_ids(model_dir, self.special_tokens.get("eos_token"))
        self.chat_template = _chat_template(model_dir, settings) or DEFAULT_CHAT_TEMPLATE

    def _eos_ids(self, model_dir: Path, eos_text: str | None) -> tuple[int, ...]:
        ids: list[int] = []
        for path in (model_dir / "generation_config.json", model_dir / "config.json"):
            value = _read_json(path).get("eos_token_id")
            ids += value if isinstance(value, list) else ([value] if value is not None else [])
        if eos_text is not None and (eos_id := self._tokenizer.token_to_id(eos_text)) is not None:
            ids.append(eos_id)
        return tuple(dict.fromkeys(int(i) for i in ids))

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        # Some checkpoints ask for a BOS in tokenizer_config.json that tokenizer.json's
        # post-processor does not add.
        bos = self.bos_token_id
        if add_special_tokens and self._add_bos and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text: str = self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """A byte-level BPE token's characters mapped back through GPT-2's byte-to-character
        map (the ``ByteLevel`` decoder's), a byte-fallback piece ``<0xHH>`` its byte; special
        and added tokens, and other vocabularies, their decoded text."""
        pieces: list[bytes] = []
        for token_id in ids:
            piece = None if token_id in self._added_ids else self._tokenizer.id_to_token(token_id)
            if piece is not None and len(piece) == 6 and piece[:3] == "<0x" and piece[5] == ">":
                pieces.append(bytes.fromhex(piece[3:5]))
            elif piece is not None and self._byte_level and all(c in _GPT2_BYTE_OF for c in piece):
                pieces.append(bytes(_GPT2_BYTE_OF[c] for c in piece))
            else:
                pieces.append(self.decode([token_id], skip_special_tokens=False).encode())
        return pieces


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        content = value.get("content")
        return str(content) if content is not None else None
    return str(value) if value is not None else None


def _chat_template(model_dir: Path, settings: dict[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default") or next(iter(named.values()), None)
    return str(template) if template else None


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """`HFTokenizer` when ``tokenizer.json`` exists, else a `ByteTokenizer`."""
    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.json").is_file():
        return HFTokenizer(model_dir)
    config = _read_json(model_dir / "config.json")
    eos = config.get("eos_token_id", 257)
    eos_ids = tuple(eos) if isinstance(eos, list) else (int(eos),)
    logger.info("no tokenizer.json in %s: using the byte-level tokenizer", model_dir)
    return ByteTokenizer(eos_token_ids=eos_ids)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas (the vLLM prefix/read-offset scheme).

    Text is re-decoded from a small window that starts a few tokens back, so tokenizers whose
    decoding depends on the previous token (leading spaces, byte fallback) stay correct. A delta
    ending in U+FFFD is held back: the token completes only part of a UTF-8 character and a
    later token will finish it.
    """

    # Tokens of the prompt that seed the decoding window (vLLM uses 5 as well).
    _PROMPT_WINDOW = 5

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids)
        self.prefix_offset = max(len(self.ids) - self._PROMPT_WINDOW, 0)
        self.read_offset = len(self.ids)
        self.output_text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one generated token; returns the text it completes (possibly "")."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """Text still held back at the end of the stream (e.g. a truncated character)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.output_text += delta
        return delta
