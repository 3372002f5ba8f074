"""The pdserve engine: paged KV cache, continuous batching scheduler, sampler, model runner.

Exports are imported lazily so that ``import workers.engine`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.engine.config import EngineConfig
    from workers.engine.engine_core import EngineCore
    from workers.engine.llm import LLM
    from workers.engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "EngineCore", "SamplingParams"]

_EXPORTS = {
    "LLM": "workers.engine.llm",
    "EngineConfig": "workers.engine.config",
    "EngineCore": "workers.engine.engine_core",
    "SamplingParams": "workers.engine.sampling_params",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
