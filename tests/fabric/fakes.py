"""Stand-ins for the native binding, each named as such where a test uses it.

`BindingLog` is a spy: it forwards every call into the real binding and records some (write
posts, region and endpoint closes, late wakes). `FakeCqOps` is a NAMED TEST FAULT: it swaps the
provider's CQ read functions for ones that misbehave in ways a real provider here cannot be made
to (a local completion flagged FI_REMOTE_CQ_DATA, an error entry that cannot be read).
`harness.StuckPosts` (a post that never returns) is the third.
"""

from __future__ import annotations

import ctypes
import errno
from collections.abc import Callable
from typing import Any

import pytest

from workers.fabric import TransferEngine, endpoint, progress, registration, wakeup
from workers.fabric._lib import ffi, lib
from workers.fabric.errors import EngineClosedError


class BindingLog:
    """A spy in place of the binding where the fabric posts writes (`progress.lib`), closes
    regions (`registration.lib`) and endpoints (`endpoint.lib`) and wakes its progress thread
    (`wakeup.lib`): forwards every call and records write posts, region and endpoint closes,
    and wakes. A wake of an endpoint already closed is recorded and not forwarded (it would
    write to a freed engine)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.events: list[tuple[str, Any]] = []
        self.closed_engines: list[Any] = []
        self.late_wakes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def pd_post_writes(self, *args: Any) -> int:
        posted = int(self.real.pd_post_writes(*args))
        if posted:
            self.events.append(("post", posted))
        return posted

    def pd_mr_close(self, mr: Any) -> int:
        self.events.append(("close", mr))
        return int(self.real.pd_mr_close(mr))

    def pd_engine_close(self, native: Any) -> int:
        rc = int(self.real.pd_engine_close(native))
        self.events.append(("engine_close", rc))
        self.closed_engines.append(native)
        return rc

    def pd_wake(self, native: Any) -> int:
        if any(native == closed for closed in self.closed_engines):
            self.late_wakes += 1
            return 0
        return int(self.real.pd_wake(native))

    def closed(self, handle: Any) -> bool:
        return any(kind == "close" and value == handle.mr for kind, value in self.events)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for module in (progress, registration, endpoint, wakeup):
            monkeypatch.setattr(module, "lib", self)


_READ = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_READERR = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64)
_FI_CLASS_CQ = 14  # fabric.h's enum: UNSPEC, FABRIC, DOMAIN, EP, ..., MR, EQ, CQ
_DATA_ENTRY = 40  # struct fi_cq_data_entry: op_context, flags, len, buf, data


class FakeCqOps:
    """NAMED TEST FAULT: the engine's CQ answers through a copy of the provider's operation
    table whose ``read`` / ``readerr`` are replaced (the rest are the provider's). Installed
    and removed on the progress thread (`install`), or once it has ended (`remove`).

    Layouts read here: `struct pd_engine` (workers/fabric/csrc/pd_fabric.h) starts with info,
    fabric, domain, cq; `struct fid_cq` is a `struct fid` (fclass, context, ops) followed by its
    `fi_ops_cq *`."""

    def __init__(
        self,
        engine: TransferEngine,
        read: Callable[[Any, int, int], int] | None = None,
        readerr: Callable[[int, int, int], int] | None = None,
    ) -> None:
        self.engine = engine
        native = int(ffi.cast("uintptr_t", engine._native))
        cq = ctypes.c_void_p.from_address(native + 3 * 8).value or 0
        assert ctypes.c_size_t.from_address(cq).value == _FI_CLASS_CQ, "not the engine's CQ"
        self._ops = ctypes.c_void_p.from_address(cq + 3 * 8)
        self._original = self._ops.value or 0
        provider_table = (ctypes.c_void_p * 8).from_address(self._original)
        self._table = (ctypes.c_void_p * 8)(*provider_table)
        self.real_read = _READ(provider_table[1])
        self._callbacks: list[Any] = []  # the C function pointers must outlive their use
        if read is not None:
            self._table[1] = self._function(_READ(lambda c, b, n: read(self, c, b, n)))
        if readerr is not None:
            self._table[3] = self._function(_READERR(readerr))

    def _function(self, callback: Any) -> int | None:
        self._callbacks.append(callback)
        return ctypes.cast(callback, ctypes.c_void_p).value

    def install(self) -> None:
        self.engine._loop.call(lambda: setattr(self._ops, "value", ctypes.addressof(self._table)))

    def remove(self) -> None:
        try:
            self.engine._loop.call(lambda: setattr(self._ops, "value", self._original))
        except EngineClosedError:  # the loop ended (or was abandoned in it): one pointer store
            self._ops.value = self._original


def misflag_local_completions(fake: FakeCqOps, cq: Any, buf: int, count: int) -> int:
    """A provider that sets FI_REMOTE_CQ_DATA on completions of our own writes and sends."""
    n = int(fake.real_read(cq, buf, count))
    for k in range(max(n, 0)):
        flags = ctypes.c_uint64.from_address(buf + k * _DATA_ENTRY + 8)
        if flags.value & (lib.FI_WRITE | lib.FI_SEND) and not flags.value & lib.FI_RECV:
            flags.value |= lib.FI_REMOTE_CQ_DATA
    return n


def always_an_error(_fake: FakeCqOps, _cq: Any, _buf: int, _count: int) -> int:
    """A CQ whose every read reports an error entry (-FI_EAVAIL)."""
    return int(-lib.FI_EAVAIL)


def unreadable_error(_cq: int, _buf: int, _flags: int) -> int:
    """An error entry that fi_cq_readerr cannot return."""
    return -errno.EIO
