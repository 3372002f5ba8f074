"""Loader of the compiled cffi module; the only place that imports it at run time.

`ffi` and `lib` are typed by the stub `_fabric_cffi.pyi`, so mypy checks every call into C.
The opaque cdata types the stub names (`PdEngine`, `IntPointer`, ...) exist for the type
checker only: other modules import them from `workers.fabric._fabric_cffi` under
`TYPE_CHECKING`.
"""

from __future__ import annotations

import os

from workers.fabric.errors import FabricUnavailableError

# Debian's libfabric links the psm provider's libinfinipath, whose load-time constructor installs
# a SIGSEGV handler that writes `<prog>.80s-<pid>,<host>.btr` backtrace files into the working
# directory of any process that later crashes (a killed Ray worker, say). It reads these
# variables when the library loads, so they must be set before the binding is imported.
os.environ.setdefault("IPATH_NO_BACKTRACE", "1")
os.environ.setdefault("IPATH_NO_CPUAFFINITY", "1")

try:
    from workers.fabric import _fabric_cffi
except ImportError as exc:  # pragma: no cover - depends on the build
    raise FabricUnavailableError(
        "the libfabric binding workers.fabric._fabric_cffi is not built: run "
        "`bash scripts/install.sh` (or `python workers/fabric/_build.py`); it needs the apt "
        f"package libfabric-dev ({exc})"
    ) from exc

ffi = _fabric_cffi.ffi
lib = _fabric_cffi.lib


def strerror(code: int) -> str:
    """Readable text of a libfabric error code (either sign)."""
    return ffi.string(lib.fi_strerror(abs(code))).decode(errors="replace")


def version() -> tuple[int, int]:
    """Runtime libfabric (major, minor)."""
    packed = int(lib.fi_version())
    return packed >> 16, packed & 0xFFFF
