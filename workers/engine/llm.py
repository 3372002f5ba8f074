"""Offline batch generation on top of ``EngineCore`` (the mixed role)."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workers.engine.config import EngineConfig
from workers.engine.engine_core import EngineCore
from workers.engine.errors import InvalidRequestError
from workers.engine.sampling_params import SamplingParams
from workers.engine.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    arrival_time: float  # time.perf_counter() when the request was added
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # perf_counter() per token
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival_time if self.token_times else None

    @property
    def mean_inter_token_latency(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


class LLM:
    """``LLM(model_dir, **EngineConfig options).generate(prompts, SamplingParams(...))``."""

    def __init__(self, model_dir: str | Path, *, detokenize: bool = True, **engine_options: Any):
        """``engine_options``: `EngineConfig`'s fields; ``speculative_config`` (a mapping, as
        vLLM's) is its ``speculative``, e.g. ``{"method": "ngram", "num_speculative_tokens":
        3}``."""
        spec = engine_options.pop("speculative_config", None)
        if spec is not None and not isinstance(spec, SpeculativeConfig):
            spec = SpeculativeConfig.from_dict(dict(spec))
        if spec is not None:
            engine_options["speculative"] = spec
        config = EngineConfig(**engine_options)
        if config.role != "mixed":
            raise ValueError("LLM runs the mixed role; drive EngineCore directly for the others")
        self.engine = EngineCore(model_dir, config, detokenize=detokenize)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's tensor-parallel followers, if any."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """One result per prompt, in order. Prompts are strings or lists of token ids."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise InvalidRequestError("one SamplingParams per prompt, or a single one")
        token_prompts = [self._tokens(p) for p in prompt_list]

        results: dict[str, GenerationResult] = {}
        try:
            for prompt_ids, params in zip(token_prompts, params_list, strict=True):
                request_id = f"llm-{next(self._ids)}"
                arrival = time.perf_counter()
                self.engine.add_request(request_id, prompt_ids, params)
                results[request_id] = GenerationResult(request_id, list(prompt_ids), arrival)
            self._run(results)
        except BaseException:
            for request_id in results:
                self.engine.abort(request_id)
            while self.engine.has_unfinished():
                self.engine.step()
            raise
        return list(results.values())

    def _run(self, results: dict[str, GenerationResult]) -> None:
        while self.engine.has_unfinished():
            for output in self.engine.step():
                result = results[output.request_id]
                result.token_ids.extend(output.new_token_ids)
                result.token_times.extend(output.token_times)
                result.logprobs.extend(output.logprobs or [])
                result.text += output.new_text
                if output.finished:
                    result.finish_reason = output.finish_reason

    def _tokens(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("text prompts need a tokenizer; the checkpoint has none")
            tokens: list[int] = self.tokenizer.encode(prompt)
            return tokens
        return list(prompt)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """A single prompt (a string, or a list of ints) becomes a list of one."""
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(p, int) for p in items):
        return [items]  # type: ignore[list-item]
    if not items:
        raise InvalidRequestError("no prompts given")
    return items  # type: ignore[return-value]
