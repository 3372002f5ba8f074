"""cffi API-mode build of the libfabric binding (`workers.fabric._fabric_cffi`).

The C side is deliberately small and flat: it owns the fid objects of one endpoint, a pool of
operation contexts, and three hot-path helpers (post a batch of writes, drain the completion
queue into arrays, wait for work) so that Python never loops per completion or per page.
Everything else (validation, descriptors, counters, callbacks) lives in Python.

The C lives in `csrc/`: one `.c` file per job (fi_info queries, the endpoint, memory
registration, posting, CQ polling) over the internal headers `pd_fabric.h` and `slots.h`; the
cdef is `pd_types.h` (structs shared with C) followed by `pd_api.cdef`. The typed Python view
of the result is `_fabric_cffi.pyi`, kept in step with `pd_api.cdef` by hand.

Built by `pip install --no-build-isolation -e .` through `setup.py`'s `cffi_modules`, or in
place with `python workers/fabric/_build.py` (what `scripts/install.sh` runs as well, because an
editable install does not always leave the extension next to the sources).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from cffi import FFI

MODULE_NAME = "workers.fabric._fabric_cffi"
ROOT = Path(__file__).resolve().parents[2]

CSRC = Path(__file__).resolve().parent / "csrc"
# Compiled in this order as one translation unit (the cffi module's own source, so the slot
# helpers in slots.h inline into the posting and CQ paths); `#line` keeps compiler messages
# pointing at the files in csrc/.
C_FILES = ("info.c", "endpoint.c", "regions.c", "post.c", "poll.c")
# What Python sees: the structs (also #included by the C side), then constants and functions.
CDEF_FILES = ("pd_types.h", "pd_api.cdef")


def _c_source() -> str:
    files = [f'#line 1 "{CSRC / name}"\n{(CSRC / name).read_text()}' for name in C_FILES]
    # What cffi appends (its wrappers) is its own file again, not the tail of the last one.
    return "\n".join([*files, '#line 1 "cffi wrappers (generated)"\n'])


def _cdef() -> str:
    return "\n".join((CSRC / name).read_text() for name in CDEF_FILES)


def _prefix_dirs(subdir: str) -> list[str]:
    prefix = os.environ.get("LIBFABRIC_PREFIX")
    return [str(Path(prefix) / subdir)] if prefix else []


def _check_headers() -> None:
    candidates = [*_prefix_dirs("include"), "/usr/include", "/usr/local/include"]
    if not any((Path(d) / "rdma" / "fabric.h").is_file() for d in candidates):
        raise SystemExit(
            "error: libfabric headers (rdma/fabric.h) not found; install the apt package "
            "libfabric-dev (apt-get install libfabric-dev libfabric1), or set LIBFABRIC_PREFIX "
            "to a libfabric >= 1.17 install prefix"
        )


_check_headers()
ffibuilder = FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    MODULE_NAME,
    _c_source(),
    libraries=["fabric"],
    include_dirs=[str(CSRC), *_prefix_dirs("include")],
    library_dirs=_prefix_dirs("lib"),
    extra_compile_args=["-O2", "-Wall", "-Wno-unused-function"],
)


def build_in_place() -> Path:
    """Compile the extension next to the sources (what an editable install imports).

    setuptools' editable install already builds it in place; this is the fallback that
    `scripts/install.sh` runs when the import still fails (other setuptools versions/modes).
    Stale copies with other ABI tags are removed first: the interpreter would prefer a
    `.cpython-*` one over a fresh `.abi3` one.
    """
    built = Path(ffibuilder.compile(tmpdir=str(ROOT / "build" / "cffi"), verbose=False))
    package_dir = ROOT / "workers" / "fabric"
    for stale in package_dir.glob("_fabric_cffi*.so"):
        stale.unlink()
    target = package_dir / built.name
    target.write_bytes(built.read_bytes())
    return target


if __name__ == "__main__":
    sys.stdout.write(f"built {build_in_place().relative_to(ROOT)}\n")
