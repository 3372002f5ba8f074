"""Serializable remote references (`*Descriptor`): what a peer needs to write into our memory.

Wire format of `MemoryRegionDescriptor` (version 1, little-endian, 32 bytes + provider name)::

    magic  "PDMR"   4 bytes
    version         u8   (1)
    flags           u8   bit 0: base is a virtual address (FI_MR_VIRT_ADDR)
    provider_len    u8
    reserved        u8   (0)
    base            u64  remote address of byte 0 of the region: its virtual address when the
                         provider uses FI_MR_VIRT_ADDR, else 0 (offset addressing)
    length          u64  bytes
    key             u64  the key to use remotely: fi_mr_key(), i.e. the provider's key under
                         FI_MR_PROV_KEY, the requested one otherwise
    provider        provider_len bytes of ASCII (e.g. "tcp;ofi_rxm")

Remote address of byte `offset` is always `base + offset`, so callers never see the provider's
addressing mode. Providers whose keys do not fit 64 bits (FI_MR_RAW) are not supported.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from workers.fabric.errors import DescriptorError

_MAGIC = b"PDMR"
_VERSION = 1
_HEADER = struct.Struct("<4sBBBBQQQ")
_FLAG_VIRT_ADDR = 0x1
_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class MemoryRegionDescriptor:
    """A peer's registered region, as received through the control plane."""

    provider: str
    base: int
    length: int
    key: int
    virt_addr: bool

    def __post_init__(self) -> None:
        if not self.provider or len(self.provider.encode()) > 255 or not self.provider.isascii():
            raise DescriptorError(f"bad provider name {self.provider!r}")
        if self.length <= 0 or not 0 <= self.base <= _U64 or self.base + self.length - 1 > _U64:
            raise DescriptorError(f"bad extent base={self.base:#x} length={self.length}")
        if not 0 <= self.key <= _U64:
            raise DescriptorError(f"key {self.key:#x} does not fit 64 bits")
        if not self.virt_addr and self.base != 0:
            raise DescriptorError("offset-addressed region must have base 0")

    def remote_address(self, offset: int) -> int:
        """Address to hand to fi_write for byte `offset` of the region."""
        return self.base + offset

    def to_bytes(self) -> bytes:
        provider = self.provider.encode()
        flags = _FLAG_VIRT_ADDR if self.virt_addr else 0
        header = _HEADER.pack(
            _MAGIC, _VERSION, flags, len(provider), 0, self.base, self.length, self.key
        )
        return header + provider

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> MemoryRegionDescriptor:
        raw = bytes(data)
        if len(raw) < _HEADER.size:
            raise DescriptorError(f"descriptor is {len(raw)} bytes, shorter than its header")
        magic, version, flags, provider_len, reserved, base, length, key = _HEADER.unpack_from(raw)
        if magic != _MAGIC:
            raise DescriptorError(f"not a memory region descriptor (magic {magic!r})")
        if version != _VERSION:
            raise DescriptorError(f"descriptor version {version}, this build reads {_VERSION}")
        if reserved != 0 or flags & ~_FLAG_VIRT_ADDR:
            raise DescriptorError(f"unknown descriptor flags {flags:#x}/{reserved:#x}")
        if len(raw) != _HEADER.size + provider_len:
            raise DescriptorError(
                f"descriptor is {len(raw)} bytes, expected {_HEADER.size + provider_len}"
            )
        try:
            provider = raw[_HEADER.size :].decode("ascii")
        except UnicodeDecodeError as exc:
            raise DescriptorError("descriptor provider name is not ASCII") from exc
        return cls(provider, base, length, key, bool(flags & _FLAG_VIRT_ADDR))
