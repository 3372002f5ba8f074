"""Opening and closing one native endpoint (`pd_engine`: fabric, domain, CQ, AV, endpoint)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from workers.fabric._lib import ffi, lib, strerror
from workers.fabric.errors import FabricUnavailableError, ProviderError
from workers.fabric.messages import MAX_ADDRESS_BYTES
from workers.fabric.providers import FabricInfo, describe, fi_info_list

if TYPE_CHECKING:
    from workers.fabric._fabric_cffi import PdEngine

log = logging.getLogger(__name__)


def open_endpoint(
    provider: str, node: str | None, domain: str | None, num_slots: int, hmem: bool
) -> tuple[FabricInfo, PdEngine]:
    """Open an endpoint on ``domain`` (None: the provider's first) with ``num_slots``
    operation contexts; FI_HMEM when ``hmem``."""
    with fi_info_list(provider, node, want_hmem=hmem) as info_list:
        infos = describe(info_list)
        index = 0
        if domain is not None:
            names = [info.domain for info in infos]
            if domain not in names:
                raise FabricUnavailableError(f"{provider}: no domain {domain!r} in {names}")
            index = names.index(domain)
        error = ffi.new("char[256]")
        native = lib.pd_engine_open(info_list, index, num_slots, error, len(error))
        if native == ffi.NULL:
            raise ProviderError(f"{provider}: {ffi.string(error).decode()}")
        return infos[index], native


def endpoint_name(native: PdEngine) -> bytes:
    """The endpoint's address, as peers insert it (`TransferEngine.add_peer`)."""
    buffer = ffi.new("char[]", MAX_ADDRESS_BYTES)
    length = ffi.new("size_t *", MAX_ADDRESS_BYTES)
    rc = lib.pd_engine_getname(native, buffer, length)
    if rc != 0:
        raise ProviderError(f"fi_getname: {strerror(rc)}", -rc)
    return bytes(ffi.buffer(buffer, length[0]))


def close_endpoint(native: PdEngine, provider: str) -> None:
    """Close every fid of the endpoint (its regions must be closed first); a failure is
    logged: everything is freed either way."""
    rc = lib.pd_engine_close(native)
    if rc != 0:
        log.error("closing the %s endpoint: %s (%d)", provider, strerror(rc), rc)
