"""Build of the engine's CPU kernels into `workers/engine/attention/_attention_cpu.so`, one torch
operator library: the attention kernels (`csrc/paged_decode.cpp`, `csrc/paged_prefill.cpp`:
``torch.ops.pdserve.paged_decode_attention`` and ``paged_prefill_attention``, loaded by
`cpu_kernel`) and the decoder layer's fused element-wise steps
(`workers/engine/fused/csrc/elementwise.cpp`: ``rms_norm``, ``add_rms_norm``, ``silu_mul``,
``rotate_``, loaded by `workers.engine.fused`).

Compiled against the torch in this interpreter (its headers and libraries), with OpenMP so that
the kernel's ``at::parallel_for`` runs on torch's own intra-op threads: the library needs
``libgomp.so.1``, which torch has already loaded by then, so both share one thread pool. One
build serves any x86-64 CPU: the kernels carry AVX-512, AVX2 and baseline copies and pick one
when they load.

    python workers/engine/attention/_build_cpu.py     # what scripts/install.sh runs

Takes about a minute on two cores; rebuilds only when a source or the torch version changed (a
stamp next to the library records both).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = (
    HERE / "csrc" / "paged_decode.cpp",
    HERE / "csrc" / "paged_prefill.cpp",
    HERE.parent / "fused" / "csrc" / "elementwise.cpp",
)
HEADERS = (HERE / "csrc" / "vec.h",)
LIBRARY = HERE / "_attention_cpu.so"
STAMP = HERE / "_attention_cpu.stamp"


def _fingerprint() -> str:
    import torch

    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.read_bytes())
    digest.update(torch.__version__.encode())
    return digest.hexdigest()


def command(output: Path) -> list[str]:
    import torch
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise SystemExit(
            "error: no C++ compiler (c++ or g++) for the CPU attention kernel; install g++ "
            "(apt-get install g++) or set CXX"
        )
    abi = int(torch.compiled_with_cxx11_abi())
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    libraries = [f"-L{path}" for path in cpp_extension.library_paths()]
    return [
        compiler,
        "-O3",
        "-std=c++20",
        "-fPIC",
        "-shared",
        # OpenMP for at::parallel_for; no -ffast-math, which would also switch the whole process
        # to flush-to-zero. -fno-math-errno lets floor() compile to one instruction.
        "-fopenmp",
        "-fno-math-errno",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *includes,
        *(str(path) for path in SOURCES),
        *libraries,
        "-lc10",
        "-ltorch_cpu",
        "-o",
        str(output),
    ]


def build(force: bool = False) -> Path:
    """Compiles the library unless an up-to-date one is there; returns its path."""
    fingerprint = _fingerprint()
    if (
        not force
        and LIBRARY.is_file()
        and STAMP.is_file()
        and STAMP.read_text().strip() == fingerprint
    ):
        return LIBRARY
    # Written next to the target and renamed into place: a process loading the library never
    # sees a half-written file.
    partial = LIBRARY.with_suffix(f".{os.getpid()}.tmp")
    print("compiling the engine's CPU kernels (about a minute)...", file=sys.stderr, flush=True)
    try:
        result = subprocess.run(command(partial), capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise SystemExit(
                f"error: building the CPU attention kernel failed:\n{result.stderr.strip()}"
            )
        partial.replace(LIBRARY)
    finally:
        partial.unlink(missing_ok=True)
    STAMP.write_text(fingerprint + "\n")
    return LIBRARY


if __name__ == "__main__":
    print(f"built {build(force='--force' in sys.argv[1:])}")
