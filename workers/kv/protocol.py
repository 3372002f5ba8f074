"""Control messages between the decoder's and the prefill worker's KV messengers.

Wire format (msgpack, never pickle): one array ``[version, message_type, field, ...]`` with the
fields of the message in the order of its dataclass. Page and token ids travel as little-endian
uint32 byte strings (4 bytes each: compact, and decoded without a per-item type check). Decoding
is strict: an unknown version or type, a missing or extra field, a wrong type, an out-of-range
number or an oversized list raises `ProtocolError`, never anything else. A version bump is the
only way to change a message; a peer on another version is rejected, not guessed at.

Flow (see README): decoder -> `PrefillRequest`; prefill -> `PrefillAccepted` or
`PrefillRejected`; decoder may send `AbortPrefill`, answered by `AbortAcknowledged`; a prefill
worker that gives up on a transfer it had started (write error, its deadline, engine error,
shutdown) sends `PrefillFailed`. KV itself moves by RDMA writes and there is no "done" message.

`PrefillFailed` (type 6) was added to version 1 without a bump: no existing message changed,
and a peer that predates it drops it as an unknown type (strict decoding) and falls back to its
transfer deadline, which is what it did before.

Authentication: workers of a cluster share a secret (`orchestrator.control`, generated per
cluster and handed to every worker). With it, every control message is followed by the 32-byte
HMAC-SHA256 of its bytes under the secret, and a message whose MAC is missing or wrong is
refused (`UnauthenticatedMessageError`) before it is parsed: a process that can reach a
worker's fabric endpoint but lacks the secret cannot have a prefill worker write anywhere, nor
abort a decoder's transfers. (Authenticity only: the messages are not encrypted, and the KV
writes themselves are one-sided, keyed by the registered regions' keys.)

Optional trailing fields (``_OPTIONAL_TAIL``): fields appended to a version-1 message later.
They are encoded only when they differ from their default, so a message that does not use them
is byte-identical to what an older peer sends and expects; a message missing them decodes with
the defaults. `PrefillRequest.checksum`, ``prefill_incarnation``, ``decode_incarnation``,
``mtp_layers``, ``skip_pages``, ``nic_addresses`` and ``nic_descriptors``. A decoder with one NIC
sends the last two empty, so its requests are byte for byte what they were before; one with
several needs prefill workers that know them (an older one drops the request as malformed, and
the decoder's request ends at its deadline).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
from abc import ABC, abstractmethod
from typing import ClassVar

import msgpack
import numpy as np

from workers.engine.errors import HeadPlacementError
from workers.kv.errors import ProtocolError, ShardingError, UnauthenticatedMessageError
from workers.kv.pages import num_pages_for_tokens
from workers.kv.sharding import GroupSharding

PROTOCOL_VERSION = 1

MAX_MESSAGE_BYTES = 64 << 20
MAX_TOKENS = 1 << 21
MAX_RANKS = 256
MAX_ID_CHARS = 256
MAX_DESCRIPTOR_BYTES = 4096
MAX_NICS = 16  # a decoder's NICs, its primary one included
MAX_ADDRESS_BYTES = 256  # a fabric endpoint address (tcp: a sockaddr; shm: a name)
MAX_DETAIL_BYTES = 1024  # UTF-8 bytes, as msgpack's max_str_len counts (`decode_message`)
MAX_STR_BYTES = MAX_DETAIL_BYTES  # every str field's wire limit (a request id's 256 chars fit)
U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1


class MessageType(enum.IntEnum):
    PREFILL_REQUEST = 1
    PREFILL_ACCEPTED = 2
    PREFILL_REJECTED = 3
    ABORT_PREFILL = 4
    ABORT_ACKNOWLEDGED = 5
    PREFILL_FAILED = 6


class RejectReason(enum.IntEnum):
    TOO_LONG = 1  # prompt exceeds what the prefill worker serves at all
    NO_PAGES = 2  # no KV pages free right now; the router may retry elsewhere
    OVERLOADED = 3  # queue full
    INCOMPATIBLE = 4  # model / page geometry / sharding the prefill group cannot serve
    WRITE_COUNT_MISMATCH = 5  # the decoder's expected count differs from the prefill's plan
    DRAINING = 6  # worker is shutting down
    INTERNAL = 7


class FailReason(enum.IntEnum):
    """Why a prefill worker gave up on a transfer it had started (`PrefillFailed`)."""

    DEADLINE = 1  # the request's timeout_ms passed on the prefill side
    WRITE_ERROR = 2  # a KV / context write failed: the decoder's count can never be reached
    ENGINE_ERROR = 3  # the engine ended or refused the request
    DRAINING = 4  # the worker is shutting down
    INTERNAL = 5


class _Field(ABC):
    """One message field: checks the Python value and converts it to and from the wire."""

    @abstractmethod
    def check(self, name: str, value: object) -> None: ...

    def to_wire(self, value: object) -> object:
        return value

    def from_wire(self, name: str, raw: object) -> object:
        return raw  # checked by the message's __post_init__


@dataclasses.dataclass(frozen=True)
class _Int(_Field):
    low: int = 0
    high: int = U32_MAX

    def check(self, name: str, value: object) -> None:
        # bool is an int subclass; a True where a count belongs is a peer bug.
        if type(value) is not int or not self.low <= value <= self.high:
            raise ProtocolError(f"{name} must be an int in [{self.low}, {self.high}]: {value!r}")


class _Bool(_Field):
    def check(self, name: str, value: object) -> None:
        if type(value) is not bool:
            raise ProtocolError(f"{name} must be a bool: {value!r}")


@dataclasses.dataclass(frozen=True)
class _Str(_Field):
    """``min_len..max_len`` characters and at most ``max_bytes`` UTF-8 bytes: the receiver's
    msgpack limit counts bytes, so a str within a character bound alone could be refused there."""

    min_len: int
    max_len: int
    max_bytes: int = MAX_STR_BYTES

    def check(self, name: str, value: object) -> None:
        if type(value) is not str or not self.min_len <= len(value) <= self.max_len:
            raise ProtocolError(f"{name} must be a str of {self.min_len}..{self.max_len} chars")
        try:
            num_bytes = len(value.encode("utf-8"))
        except UnicodeEncodeError:  # a lone surrogate: msgpack could not pack it
            raise ProtocolError(f"{name} is not valid UTF-8 text") from None
        if num_bytes > self.max_bytes:
            raise ProtocolError(f"{name} is {num_bytes} UTF-8 bytes, at most {self.max_bytes}")


def truncate_detail(text: str, max_bytes: int = MAX_DETAIL_BYTES) -> str:
    """``text`` cut to at most ``max_bytes`` UTF-8 bytes at a character boundary, for a
    message's ``detail`` (characters UTF-8 cannot carry, lone surrogates, become "?")."""
    return text.encode("utf-8", "replace")[:max_bytes].decode("utf-8", "ignore")


@dataclasses.dataclass(frozen=True)
class _Bytes(_Field):
    max_len: int

    def check(self, name: str, value: object) -> None:
        if type(value) is not bytes or len(value) > self.max_len:
            raise ProtocolError(f"{name} must be bytes of at most {self.max_len}")


@dataclasses.dataclass(frozen=True)
class _Enum(_Field):
    cls: type[enum.IntEnum]

    def check(self, name: str, value: object) -> None:
        if not isinstance(value, self.cls):
            raise ProtocolError(f"{name} must be a {self.cls.__name__}: {value!r}")

    def to_wire(self, value: object) -> object:
        return int(value)  # type: ignore[call-overload]

    def from_wire(self, name: str, raw: object) -> object:
        if type(raw) is not int or raw not in self.cls._value2member_map_:
            raise ProtocolError(f"{name}: unknown {self.cls.__name__} {raw!r}")
        return self.cls(raw)


@dataclasses.dataclass(frozen=True)
class _IdArray(_Field):
    """tuple of uint32 ids <-> little-endian uint32 bytes."""

    min_len: int
    max_len: int

    def check(self, name: str, value: object) -> None:
        if type(value) is not tuple or not self.min_len <= len(value) <= self.max_len:
            raise ProtocolError(f"{name} must be a tuple of {self.min_len}..{self.max_len} ids")
        if not all(type(v) is int and 0 <= v <= U32_MAX for v in value):
            raise ProtocolError(f"{name} must hold ints in [0, {U32_MAX}]")

    def to_wire(self, value: object) -> object:
        return np.asarray(value, dtype="<u4").tobytes()

    def from_wire(self, name: str, raw: object) -> object:
        if type(raw) is not bytes or len(raw) % 4 != 0:
            raise ProtocolError(f"{name} must be packed uint32 bytes")
        return tuple(np.frombuffer(raw, dtype="<u4").tolist())


@dataclasses.dataclass(frozen=True)
class _Tuple(_Field):
    item: _Field
    min_len: int
    max_len: int

    def check(self, name: str, value: object) -> None:
        if type(value) is not tuple or not self.min_len <= len(value) <= self.max_len:
            raise ProtocolError(f"{name} must be a tuple of {self.min_len}..{self.max_len} items")
        for index, item in enumerate(value):
            self.item.check(f"{name}[{index}]", item)

    def to_wire(self, value: object) -> object:
        assert isinstance(value, tuple)
        return [self.item.to_wire(item) for item in value]

    def from_wire(self, name: str, raw: object) -> object:
        if type(raw) is not list or len(raw) > self.max_len:
            raise ProtocolError(f"{name} must be a list of at most {self.max_len} items")
        return tuple(self.item.from_wire(f"{name}[{i}]", item) for i, item in enumerate(raw))


_REQUEST_ID = _Str(1, MAX_ID_CHARS)
_TRANSFER_ID = _Int()  # the imm of the transfer


class _Message:
    """Base of every message: field checks from ``_FIELDS`` plus a cross-field ``_validate``."""

    TYPE: ClassVar[MessageType]
    _FIELDS: ClassVar[tuple[_Field, ...]]
    _OPTIONAL_TAIL: ClassVar[int] = 0  # trailing fields added later; omitted when default

    def __post_init__(self) -> None:
        for field, spec in zip(dataclasses.fields(self), self._FIELDS, strict=True):  # type: ignore[arg-type]
            spec.check(field.name, getattr(self, field.name))
        self._validate()

    def _validate(self) -> None:
        """Rules across fields (override)."""


@dataclasses.dataclass(frozen=True)
class PrefillRequest(_Message):
    """Decoder -> prefill: prefill these tokens and write their KV into these pages.

    ``token_ids`` are every prompt token but the last (the decoder runs that one).
    ``dst_page_ids`` holds one list (the decode group's ranks share one page table) or one per
    decode rank, each with the pages of ``len(token_ids)`` tokens. ``source_sets`` is the
    decoder's choice of source replica set per destination replica set (empty: the prefill side
    chooses); under MLA, where every rank is a replica set, the source rank per decode rank
    (``decode_tp_size`` entries). ``segment_pages`` / ``max_pages_per_run`` 0 means no cut / no limit (run rule of
    `workers.kv.pages`; the decoder sets the limit from its ``max_msg_size`` and a prefill
    worker whose own limit is lower rejects with INCOMPATIBLE). ``expected_write_count``
    0 means the decoder waits for the count in `PrefillAccepted` (coalescing depends on the
    prefill's page ids). ``timeout_ms`` is relative: the two hosts' clocks are not compared.
    ``checksum`` (optional, added later, default False) asks for checksum mode
    (`workers.kv.checksum`): the context write then carries the KV's checksums; it needs a
    context descriptor. ``prefill_incarnation`` (optional, 0: any) is the incarnation of the
    `PrefillEndpoint` the decoder resolved: a restarted prefill worker rejects a request meant for
    its predecessor. ``decode_incarnation`` (optional, 0: unknown) is the decoder's own: a prefill
    worker stops its transfers into an older incarnation at the same address (the descriptors
    they write with belong to a process that is gone). ``mtp_layers`` (optional, 0: none) is the
    number of MTP layers after the model's in the decoder's pool, which it drafts with and wants
    written too (`workers.engine.mtp_drafter`); a prefill worker whose pool differs rejects with
    INCOMPATIBLE. ``skip_pages`` (optional, 0: none) is the number of leading pages of the
    prompt the decoder already holds (its prefix cache): the prefill worker still computes (or
    finds cached) their KV, but writes only the pages after them, so ``dst_page_ids`` hold the
    pages of the tokens from ``skip_pages * page_size`` on, and the write count covers only
    those; at least one page is left to write. ``nic_addresses`` (optional, empty: none) are the
    fabric addresses of the decoder's NICs after its primary one (the message's source,
    `workers.fabric.nics`), and ``nic_descriptors`` one descriptor per decode rank for each of
    them (the same pools registered with that NIC's domain: its keys): the prefill worker may
    write a request's KV through any of the decoder's NICs (`workers.kv.nic_lanes`), and all
    writes count under the one imm whichever NIC they land on. The context write always goes
    to the primary NIC (``context_descriptor``).
    """

    TYPE: ClassVar[MessageType] = MessageType.PREFILL_REQUEST
    _FIELDS: ClassVar[tuple[_Field, ...]] = (
        _REQUEST_ID,
        _TRANSFER_ID,
        _IdArray(1, MAX_TOKENS),
        _Int(1, 1 << 16),
        _Tuple(_IdArray(0, MAX_TOKENS), 1, MAX_RANKS),
        _Int(1, MAX_RANKS),
        _Int(1, 1 << 16),
        _Bool(),
        _Tuple(_Int(0, MAX_RANKS - 1), 0, MAX_RANKS),
        _Bool(),
        _Int(0, MAX_TOKENS),
        _Int(0, MAX_TOKENS),
        _Tuple(_Bytes(MAX_DESCRIPTOR_BYTES), 1, MAX_RANKS),
        _Bytes(MAX_DESCRIPTOR_BYTES),
        _Int(0, U64_MAX),
        _Int(0, U64_MAX),
        _Int(1, 1 << 31),
        _Bool(),
        _Int(0, U64_MAX),
        _Int(0, U64_MAX),
        _Int(0, 1),
        _Int(0, MAX_TOKENS),
        _Tuple(_Bytes(MAX_ADDRESS_BYTES), 0, MAX_NICS - 1),
        _Tuple(_Tuple(_Bytes(MAX_DESCRIPTOR_BYTES), 1, MAX_RANKS), 0, MAX_NICS - 1),
    )
    _OPTIONAL_TAIL: ClassVar[int] = 7

    request_id: str
    transfer_id: int
    token_ids: tuple[int, ...]
    page_size: int
    dst_page_ids: tuple[tuple[int, ...], ...]
    decode_tp_size: int
    num_kv_heads: int
    is_mla: bool
    source_sets: tuple[int, ...]
    coalesce_pages: bool
    segment_pages: int
    max_pages_per_run: int
    dst_descriptors: tuple[bytes, ...]
    context_descriptor: bytes
    context_offset: int
    expected_write_count: int
    timeout_ms: int
    checksum: bool = False
    prefill_incarnation: int = 0
    decode_incarnation: int = 0
    mtp_layers: int = 0
    skip_pages: int = 0
    nic_addresses: tuple[bytes, ...] = ()
    nic_descriptors: tuple[tuple[bytes, ...], ...] = ()

    def _validate(self) -> None:
        try:
            sharding = GroupSharding(self.decode_tp_size, self.num_kv_heads, self.is_mla)
        except (ShardingError, HeadPlacementError) as e:
            raise ProtocolError(f"decode group layout: {e}") from e
        # One per decode replica set: under MLA (every rank a set) one per decode rank.
        num_picks = sharding.num_replica_sets
        if len(self.source_sets) not in (0, num_picks):
            raise ProtocolError(f"source_sets needs 0 or {num_picks} entries")
        if len(self.dst_page_ids) not in (1, self.decode_tp_size):
            raise ProtocolError("dst_page_ids needs one list or one per decode rank")
        num_pages = num_pages_for_tokens(len(self.token_ids), self.page_size) - self.skip_pages
        if num_pages < 1:
            raise ProtocolError("skip_pages leaves no page to write")
        if any(len(pages) != num_pages for pages in self.dst_page_ids):
            raise ProtocolError(f"every dst page list needs {num_pages} pages")
        if len(self.dst_descriptors) != self.decode_tp_size:
            raise ProtocolError("dst_descriptors needs one descriptor per decode rank")
        if self.checksum and not self.context_descriptor:
            raise ProtocolError("checksum mode needs a context descriptor (it carries the sums)")
        if len(self.nic_descriptors) != len(self.nic_addresses):
            raise ProtocolError("nic_descriptors needs one entry per NIC address")
        if not all(self.nic_addresses):
            raise ProtocolError("a NIC address is empty")
        if any(len(per_rank) != self.decode_tp_size for per_rank in self.nic_descriptors):
            raise ProtocolError("each NIC's descriptors need one per decode rank")

    @property
    def decode_sharding(self) -> GroupSharding:
        return GroupSharding(self.decode_tp_size, self.num_kv_heads, self.is_mla)

    @property
    def num_context_writes(self) -> int:
        """One write of the last hidden state when the decoder asked for context."""
        return 1 if self.context_descriptor else 0

    def dst_pages_of_rank(self, rank: int) -> tuple[int, ...]:
        return self.dst_page_ids[0] if len(self.dst_page_ids) == 1 else self.dst_page_ids[rank]


@dataclasses.dataclass(frozen=True)
class PrefillAccepted(_Message):
    """Prefill -> decoder: queued; ``expected_write_count`` is exactly what it will write."""

    TYPE: ClassVar[MessageType] = MessageType.PREFILL_ACCEPTED
    _FIELDS: ClassVar[tuple[_Field, ...]] = (_REQUEST_ID, _TRANSFER_ID, _Int(1, U64_MAX))

    request_id: str
    transfer_id: int
    expected_write_count: int


@dataclasses.dataclass(frozen=True)
class PrefillRejected(_Message):
    """Prefill -> decoder: will not serve it; nothing was or will be written."""

    TYPE: ClassVar[MessageType] = MessageType.PREFILL_REJECTED
    _FIELDS: ClassVar[tuple[_Field, ...]] = (
        _REQUEST_ID,
        _TRANSFER_ID,
        _Enum(RejectReason),
        _Str(0, MAX_DETAIL_BYTES),
    )

    request_id: str
    transfer_id: int
    reason: RejectReason
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class AbortPrefill(_Message):
    """Decoder -> prefill: stop; submit no more writes for this transfer."""

    TYPE: ClassVar[MessageType] = MessageType.ABORT_PREFILL
    _FIELDS: ClassVar[tuple[_Field, ...]] = (_REQUEST_ID, _TRANSFER_ID)

    request_id: str
    transfer_id: int


@dataclasses.dataclass(frozen=True)
class AbortAcknowledged(_Message):
    """Prefill -> decoder: aborted; it submitted ``num_writes_submitted`` writes in total and
    submits none after this message (lets the decoder lift the page quarantine early)."""

    TYPE: ClassVar[MessageType] = MessageType.ABORT_ACKNOWLEDGED
    _FIELDS: ClassVar[tuple[_Field, ...]] = (_REQUEST_ID, _TRANSFER_ID, _Int(0, U64_MAX))

    request_id: str
    transfer_id: int
    num_writes_submitted: int


@dataclasses.dataclass(frozen=True)
class PrefillFailed(_Message):
    """Prefill -> decoder: gave up on a transfer it had accepted; it submitted
    ``num_writes_submitted`` writes in total (some may still be in flight) and submits none
    after this message. The decoder fails the request at once and quarantines its pages as on
    an abort (released once that many writes landed, or its process is gone)."""

    TYPE: ClassVar[MessageType] = MessageType.PREFILL_FAILED
    _FIELDS: ClassVar[tuple[_Field, ...]] = (
        _REQUEST_ID,
        _TRANSFER_ID,
        _Enum(FailReason),
        _Int(0, U64_MAX),
        _Str(0, MAX_DETAIL_BYTES),
    )

    request_id: str
    transfer_id: int
    reason: FailReason
    num_writes_submitted: int
    detail: str = ""


Message = (
    PrefillRequest
    | PrefillAccepted
    | PrefillRejected
    | AbortPrefill
    | AbortAcknowledged
    | PrefillFailed
)

_BY_TYPE: dict[int, type[_Message]] = {
    cls.TYPE: cls
    for cls in (
        PrefillRequest,
        PrefillAccepted,
        PrefillRejected,
        AbortPrefill,
        AbortAcknowledged,
        PrefillFailed,
    )
}


MAC_BYTES = 32  # HMAC-SHA256


def _mac(key: bytes, data: bytes | bytearray | memoryview) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def encode_message(message: Message, key: bytes | None = None) -> bytes:
    """The message's bytes, followed by their MAC under ``key`` when given."""
    packed = _pack(message)
    return packed + _mac(key, packed) if key else packed


def _pack(message: Message) -> bytes:
    fields = dataclasses.fields(message)
    values = [getattr(message, f.name) for f in fields]
    # Optional trailing fields at their default are left out (see the module docstring).
    num_required = len(fields) - message._OPTIONAL_TAIL
    while len(values) > num_required and values[-1] == fields[len(values) - 1].default:
        values.pop()
    wire = [spec.to_wire(value) for value, spec in zip(values, message._FIELDS, strict=False)]
    packed: bytes = msgpack.packb([PROTOCOL_VERSION, int(message.TYPE), *wire], use_bin_type=True)
    return packed


def decode_message(data: bytes | bytearray | memoryview, key: bytes | None = None) -> Message:
    """Parse one message; anything malformed raises `ProtocolError`. With ``key``, its MAC is
    checked first: missing or wrong raises `UnauthenticatedMessageError`."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolError(f"expected bytes, got {type(data).__name__}")
    if key:
        view = memoryview(data)
        body = view[:-MAC_BYTES]
        if len(view) <= MAC_BYTES or not hmac.compare_digest(
            bytes(view[-MAC_BYTES:]), _mac(key, body)
        ):
            raise UnauthenticatedMessageError("control message without the cluster's MAC")
        data = body
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        raw = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            max_str_len=MAX_STR_BYTES,
            max_bin_len=4 * MAX_TOKENS,
            max_array_len=MAX_RANKS + 16,
            max_map_len=0,
            max_ext_len=0,
        )
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as e:
        raise ProtocolError(f"not a valid msgpack message: {e}") from e
    if type(raw) is not list or len(raw) < 2:
        raise ProtocolError("a message is an array [version, type, fields...]")
    version, message_type, *values = raw
    if version != PROTOCOL_VERSION or type(version) is not int:
        raise ProtocolError(f"unsupported protocol version {version!r} (mine: {PROTOCOL_VERSION})")
    cls = _BY_TYPE.get(message_type) if type(message_type) is int else None
    if cls is None:
        raise ProtocolError(f"unknown message type {message_type!r}")
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    num_required = len(fields) - cls._OPTIONAL_TAIL
    if not num_required <= len(values) <= len(fields):
        expected = f"{num_required}..{len(fields)}" if cls._OPTIONAL_TAIL else str(len(fields))
        raise ProtocolError(f"{cls.__name__} has {expected} fields, got {len(values)}")
    decoded = [
        spec.from_wire(f.name, value)
        for f, spec, value in zip(fields, cls._FIELDS, values, strict=False)
    ]
    message: Message = cls(*decoded)  # type: ignore[assignment]
    return message
