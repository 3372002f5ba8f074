"""What a prefill worker publishes (through the control plane's registry) so decoders can use it.

Wire: msgpack array ``[version, address, provider, tp_size, num_kv_heads, is_mla,
segment_pages, page_size, incarnation]``; never pickle.

``incarnation`` versions the endpoint: a random id the prefill worker draws when it registers
its memory (`PrefillMessenger.incarnation`), so a restarted worker, with new registrations and
possibly the same fabric address, publishes a different one. A decoder keys what it caches of a
prefill peer by it and names it in each `PrefillRequest`; a prefill worker rejects a request
meant for another incarnation (`workers.kv.prefill_checks`). 0 means unversioned (an endpoint
built by hand, e.g. a test's fake): never rejected for its incarnation.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from workers.kv.errors import ProtocolError

ENDPOINT_VERSION = 2
U64_MAX = (1 << 64) - 1


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
    incarnation: int = 0

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
                self.incarnation,
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
        if type(raw) is not list or len(raw) != 9 or raw[0] != ENDPOINT_VERSION:
            raise ProtocolError(f"not a version-{ENDPOINT_VERSION} prefill endpoint")
        _, address, provider, tp_size, heads, is_mla, segment_pages, page_size, incarnation = raw
        counts = (tp_size, heads, segment_pages, page_size, incarnation)
        types_ok = (
            type(address) is bytes
            and type(provider) is str
            and all(type(v) is int and v >= 0 for v in counts)
            and type(is_mla) is bool
        )
        if not types_ok or tp_size < 1 or heads < 1 or page_size < 1 or incarnation > U64_MAX:
            raise ProtocolError("malformed prefill endpoint")
        return cls(address, provider, tp_size, heads, is_mla, segment_pages, page_size, incarnation)
