"""What a prefill worker publishes (through the control plane's registry) so decoders can use it.

Wire: msgpack array ``[version, address, provider, tp_size, num_kv_heads, is_mla,
segment_pages, page_size]``; never pickle.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from workers.kv.errors import ProtocolError

ENDPOINT_VERSION = 1


@dataclass(frozen=True)
class PrefillEndpoint:
    """``segment_pages``: the run cut that keeps the write count independent of the prefill
    scheduler's chunking (its chunk budget in pages; 0 = none, i.e. whole prompts only)."""

    address: bytes
    provider: str
    tp_size: int
    num_kv_heads: int
    is_mla: bool
    segment_pages: int
    page_size: int

    def to_bytes(self) -> bytes:
        packed: bytes = msgpack.packb(
            [
                ENDPOINT_VERSION,
                self.address,
                self.provider,
                self.tp_size,
                self.num_kv_heads,
                self.is_mla,
                self.segment_pages,
                self.page_size,
            ],
            use_bin_type=True,
        )
        return packed

    @classmethod
    def from_bytes(cls, data: bytes) -> PrefillEndpoint:
        try:
            raw = msgpack.unpackb(data, raw=False, max_map_len=0, max_ext_len=0)
        except (ValueError, TypeError, msgpack.UnpackException) as error:
            raise ProtocolError(f"not a prefill endpoint: {error}") from error
        if type(raw) is not list or len(raw) != 8 or raw[0] != ENDPOINT_VERSION:
            raise ProtocolError("not a version-1 prefill endpoint")
        _, address, provider, tp_size, heads, is_mla, segment_pages, page_size = raw
        types_ok = (
            type(address) is bytes
            and type(provider) is str
            and all(type(v) is int and v >= 0 for v in (tp_size, heads, segment_pages, page_size))
            and type(is_mla) is bool
        )
        if not types_ok or tp_size < 1 or heads < 1 or page_size < 1:
            raise ProtocolError("malformed prefill endpoint")
        return cls(address, provider, tp_size, heads, is_mla, segment_pages, page_size)
