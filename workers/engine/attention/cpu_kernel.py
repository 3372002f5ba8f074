"""The CPU attention kernels (`csrc/paged_decode.cpp`, `csrc/paged_prefill.cpp`), loaded once per
process from one library.

`paged_decode_attention()` and `paged_prefill_attention()` return the operators, or None when the
library was not built (see `_build_cpu.py`; ``make install`` builds it) or is switched off with
``PDSERVE_CPU_ATTENTION_KERNEL=0`` (for A/B measurements); the torch backend then attends with
its pure-PyTorch paths. `unavailable_reason()` says why they are missing.

`preferred()`: whether the backend should pick them by default. Only on AVX-512 CPUs: their
AVX2 copies (forced on the AVX-512 VM, `bench/engine.py --attention`) ran decode 1.2-2.3x slower
than the PyTorch paths and prefill 9-25x slower than SDPA (16-lane vectors in 16 AVX2 registers
spill); on a CPU with nothing wider (a Zen 3 VM) decode 1.3-2x and prefill 10-22x.

`prefill_preferred(dtype)`: the same for the prefill kernel, except on caches of bfloat16 (or
float16) where the CPU has AMX tiles: there torch's own flash attention runs the score and value
GEMMs on the tiles. On the 2-vCPU Xeon VM with AMX (`bench/engine.py --attention`, bfloat16, 6
layers) SDPA took 6.5 against the kernel's 13.9 ms for a 512-token prompt, 41 against 157 ms
for 1800 tokens and 10.0 against 28.6 ms for 256 tokens after 1024 cached; its decode kernel
still beats the PyTorch paths there (2.2 against 6.1 ms, batch 8 x 800), so decode keeps it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)

LIBRARY = Path(__file__).resolve().parent / "_attention_cpu.so"

# (out, q, cache, page_table, seq_lens, value_plane, scale) -> None; writes out.
PagedDecode = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], None
]
# (out, q, cache, page_table, query_starts, query_lens, seq_lens, value_plane, scale) -> None;
# writes the named rows of out.
PagedPrefill = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        int,
        float,
    ],
    None,
]


class _Loaded(NamedTuple):
    decode: PagedDecode | None
    prefill: PagedPrefill | None
    reason: str  # why they are None ("" when loaded)


_lock = threading.Lock()
_loaded: _Loaded | None = None


def _load() -> _Loaded:
    if os.environ.get("PDSERVE_CPU_ATTENTION_KERNEL", "1") == "0":
        return _Loaded(None, None, "switched off by PDSERVE_CPU_ATTENTION_KERNEL=0")
    if not LIBRARY.is_file():
        return _Loaded(None, None, f"{LIBRARY.name} is not built (run `make install`)")
    try:
        torch.ops.load_library(str(LIBRARY))
    except OSError as error:  # e.g. built against another torch: the pure-PyTorch paths still run
        reason = f"{LIBRARY.name} does not load ({error}); rebuild it with `make install`"
        logger.warning("CPU attention kernels off: %s", reason)
        return _Loaded(None, None, reason)
    ops = torch.ops.pdserve
    return _Loaded(ops.paged_decode_attention, ops.paged_prefill_attention, "")


def _get() -> _Loaded:
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
        return _loaded


def paged_decode_attention() -> PagedDecode | None:
    return _get().decode


def paged_prefill_attention() -> PagedPrefill | None:
    return _get().prefill


def preferred() -> bool:
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def amx() -> bool:
    """Whether this CPU has AMX tiles (torch's CPU flash attention then computes half-precision
    GEMMs on them)."""
    supported = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(supported is not None and supported())


def prefill_preferred(dtype: torch.dtype) -> bool:
    return preferred() and not (dtype in (torch.bfloat16, torch.float16) and amx())


def unavailable_reason() -> str:
    """Why the kernels are None ("" when they are not)."""
    return _get().reason
