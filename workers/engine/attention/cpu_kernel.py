"""The CPU decode-attention kernel (`csrc/paged_decode.cpp`), loaded once per process.

`paged_decode_attention()` returns the operator, or None when the library was not built (see
`_build_cpu.py`; ``make install`` builds it) or is switched off with
``PDSERVE_CPU_ATTENTION_KERNEL=0`` (for A/B measurements); the torch backend then attends
decode tokens with its pure-PyTorch paths. `unavailable_reason()` says why it is missing.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

LIBRARY = Path(__file__).resolve().parent / "_paged_decode_cpu.so"

# (out, q, cache, page_table, seq_lens, value_plane, scale) -> None; writes out.
PagedDecode = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], None
]

_lock = threading.Lock()
_loaded: tuple[PagedDecode | None, str] | None = None


def _load() -> tuple[PagedDecode | None, str]:
    if os.environ.get("PDSERVE_CPU_ATTENTION_KERNEL", "1") == "0":
        return None, "switched off by PDSERVE_CPU_ATTENTION_KERNEL=0"
    if not LIBRARY.is_file():
        return None, f"{LIBRARY.name} is not built (run `make install`)"
    try:
        torch.ops.load_library(str(LIBRARY))
    except OSError as error:  # e.g. built against another torch: the pure-PyTorch paths still run
        reason = f"{LIBRARY.name} does not load ({error}); rebuild it with `make install`"
        logger.warning("CPU decode-attention kernel off: %s", reason)
        return None, reason
    op: PagedDecode = torch.ops.pdserve.paged_decode_attention
    return op, ""


def paged_decode_attention() -> PagedDecode | None:
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
        return _loaded[0]


def unavailable_reason() -> str:
    """Why `paged_decode_attention()` is None ("" when it is not)."""
    paged_decode_attention()
    assert _loaded is not None
    return _loaded[1]
