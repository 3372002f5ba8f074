"""Loader of the compiled cffi module; the only place that imports it.

The cffi objects are typed `Any`: the typed surface is `engine.py`, not the C boundary.
"""

from __future__ import annotations

from typing import Any

from workers.fabric.errors import FabricUnavailableError

try:
    from workers.fabric import _fabric_cffi  # type: ignore[attr-defined]
except ImportError as exc:  # pragma: no cover - depends on the build
    raise FabricUnavailableError(
        "the libfabric binding workers.fabric._fabric_cffi is not built: run "
        "`bash scripts/install.sh` (or `python workers/fabric/_build.py`); it needs the apt "
        f"package libfabric-dev ({exc})"
    ) from exc

ffi: Any = _fabric_cffi.ffi
lib: Any = _fabric_cffi.lib


def strerror(code: int) -> str:
    """Readable text of a libfabric error code (either sign)."""
    return str(ffi.string(lib.fi_strerror(abs(code))).decode(errors="replace"))


def version() -> tuple[int, int]:
    """Runtime libfabric (major, minor)."""
    packed = int(lib.fi_version())
    return packed >> 16, packed & 0xFFFF
