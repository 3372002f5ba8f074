from __future__ import annotations

import contextlib
import dataclasses
import random

import msgpack
import pytest

from workers.kv.errors import ProtocolError, UnauthenticatedMessageError
from workers.kv.protocol import (
    MAC_BYTES,
    MAX_DETAIL_BYTES,
    MAX_ID_CHARS,
    MAX_NICS,
    MAX_RANKS,
    PROTOCOL_VERSION,
    AbortAcknowledged,
    AbortPrefill,
    FailReason,
    Message,
    MessageType,
    PrefillAccepted,
    PrefillFailed,
    PrefillRejected,
    PrefillRequest,
    RejectReason,
    decode_message,
    encode_message,
    truncate_detail,
)

EURO = "\u20ac"  # 3 UTF-8 bytes


def make_request(**overrides: object) -> PrefillRequest:
    fields: dict[str, object] = {
        "request_id": "req-1",
        "transfer_id": 3 << 20 | 17,
        "token_ids": tuple(range(40)),
        "page_size": 16,
        "dst_page_ids": ((4, 5, 9),),
        "decode_tp_size": 2,
        "num_kv_heads": 8,
        "is_mla": False,
        "source_sets": (0,),
        "coalesce_pages": True,
        "segment_pages": 4,
        "max_pages_per_run": 0,
        "dst_descriptors": (b"\x01rank0", b"\x02rank1"),
        "context_descriptor": b"ctx",
        "context_offset": 4096,
        "expected_write_count": 123,
        "timeout_ms": 30_000,
    }
    fields.update(overrides)
    return PrefillRequest(**fields)  # type: ignore[arg-type]


MESSAGES: list[Message] = [
    make_request(),
    make_request(dst_page_ids=((1, 2, 3), (7, 8, 9)), context_descriptor=b"", source_sets=()),
    make_request(checksum=True),
    make_request(mtp_layers=1),
    make_request(skip_pages=2, dst_page_ids=((9,),)),  # the decoder holds 2 of the 3 pages
    make_request(nic_addresses=(b"nic1", b"nic2"), nic_descriptors=((b"a", b"b"), (b"c", b"d"))),
    PrefillAccepted("req-1", 5, 640),
    PrefillRejected("req-1", 5, RejectReason.NO_PAGES, "pool full"),
    AbortPrefill("req-1", 5),
    AbortAcknowledged("req-1", 5, 0),
    PrefillFailed("req-1", 5, FailReason.DRAINING, 12, "shutting down"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_roundtrip(message: Message) -> None:
    data = encode_message(message)
    assert decode_message(data) == message
    assert decode_message(bytearray(data)) == message


def test_request_helpers_and_compactness() -> None:
    request = make_request(dst_page_ids=((1, 2, 3), (7, 8, 9)))
    assert request.dst_pages_of_rank(1) == (7, 8, 9)
    assert make_request().dst_pages_of_rank(1) == (4, 5, 9)
    assert request.num_context_writes == 1 and request.decode_sharding.heads_per_rank == 4
    big = make_request(token_ids=tuple(range(100_000)), dst_page_ids=(tuple(range(6250)),))
    assert len(encode_message(big)) < 4 * (100_000 + 6250) + 512


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("request_id", ""),
        ("request_id", 5),
        ("transfer_id", -1),
        ("transfer_id", 1 << 32),
        ("transfer_id", True),
        ("token_ids", ()),
        ("token_ids", (1, -2)),
        ("token_ids", [1, 2]),
        ("page_size", 0),
        ("dst_page_ids", ((4, 5),)),  # 40 tokens need 3 pages of 16
        ("dst_page_ids", ((4, 5, 9),) * 3),  # neither one list nor one per rank
        ("dst_page_ids", ()),
        ("decode_tp_size", 3),  # 8 heads cannot be split over 3 ranks
        ("is_mla", 1),
        ("source_sets", (MAX_RANKS,)),
        ("source_sets", (0, 1)),  # one decode replica set: one choice
        ("segment_pages", -1),
        ("max_pages_per_run", None),
        ("dst_descriptors", (b"x",)),
        ("dst_descriptors", ("x", "y")),
        ("context_descriptor", b"x" * 5000),
        ("expected_write_count", -3),
        ("timeout_ms", 0),
        ("skip_pages", 1),  # then 2 pages are written, not the 3 listed
        ("skip_pages", -1),
        ("nic_addresses", (b"nic1",)),  # without its descriptors
        ("nic_addresses", (b"",)),
        ("nic_addresses", ("nic1",)),
        ("nic_addresses", (b"n",) * MAX_NICS),  # one more than MAX_NICS with the primary
        ("nic_descriptors", ((b"a", b"b"),)),  # without its address
    ],
)
def test_invalid_request_fields_are_rejected(field: str, value: object) -> None:
    with pytest.raises(ProtocolError):
        make_request(**{field: value})


def test_each_nic_needs_one_descriptor_per_decode_rank() -> None:
    with pytest.raises(ProtocolError, match="one per decode rank"):
        make_request(nic_addresses=(b"nic1",), nic_descriptors=((b"only-rank-0",),))


def test_a_request_without_nics_is_what_it_was_before() -> None:
    """A single-NIC decoder's request leaves the NIC fields out: an older prefill worker reads
    it, and it is the same bytes as before they existed."""
    assert len(wire(make_request())) == 2 + 17  # version, type, the required fields
    assert len(wire(make_request(skip_pages=1, dst_page_ids=((5, 9),)))) == 2 + 22
    with_nics = wire(make_request(nic_addresses=(b"n",), nic_descriptors=((b"a", b"b"),)))
    assert with_nics[-2:] == [[b"n"], [[b"a", b"b"]]]


def test_a_request_skipping_every_page_is_rejected() -> None:
    with pytest.raises(ProtocolError, match="no page to write"):
        make_request(skip_pages=3, dst_page_ids=((),))


def test_mla_request_carries_one_source_rank_per_decode_rank() -> None:
    """Under MLA every decode rank is a replica set: ``source_sets[k]`` is the source rank of
    decode rank ``k``."""
    mla = make_request(num_kv_heads=1, is_mla=True, source_sets=(1, 0))
    assert decode_message(encode_message(mla)) == mla
    assert mla.decode_sharding.num_replica_sets == 2 and mla.decode_sharding.kv_planes == 1
    make_request(num_kv_heads=1, is_mla=True, source_sets=())  # the prefill side chooses
    with pytest.raises(ProtocolError, match="source_sets needs 0 or 2"):
        make_request(num_kv_heads=1, is_mla=True, source_sets=(1,))


def test_invalid_small_messages_are_rejected() -> None:
    with pytest.raises(ProtocolError):
        PrefillAccepted("r", 1, 0)  # zero writes: nothing would ever complete the transfer
    with pytest.raises(ProtocolError):
        PrefillRejected("r", 1, 2, "")  # type: ignore[arg-type]
    with pytest.raises(ProtocolError):
        AbortAcknowledged("r", 1, -1)
    with pytest.raises(ProtocolError):
        PrefillFailed("r", 1, FailReason.DEADLINE, -1)
    with pytest.raises(ProtocolError):
        PrefillFailed("r", 1, RejectReason.DRAINING, 0)  # type: ignore[arg-type]


def test_prefill_failed_decoding_is_strict() -> None:
    good = wire(PrefillFailed("r", 1, FailReason.WRITE_ERROR, 3, "lost"))
    assert good == [PROTOCOL_VERSION, 6, "r", 1, 2, 3, "lost"]
    for bad in (
        [*good[:4], 99, *good[5:]],  # unknown FailReason
        [*good[:5], -1, good[6]],  # negative count
        [*good[:5], True, good[6]],  # a bool is not a count
        [*good[:6], b"lost"],  # detail must be str
        good[:-1],  # field missing
        [*good, 0],  # extra field
    ):
        with pytest.raises(ProtocolError):
            decode_message(pack(bad))


def wire(message: Message) -> list[object]:
    decoded = msgpack.unpackb(encode_message(message), raw=False)
    assert isinstance(decoded, list)
    return decoded


def pack(values: object) -> bytes:
    packed: bytes = msgpack.packb(values, use_bin_type=True)
    return packed


def test_unknown_version_type_and_field_count() -> None:
    good = wire(AbortPrefill("r", 1))
    for bad in (
        [PROTOCOL_VERSION + 1, *good[1:]],
        [True, *good[1:]],
        [good[0], 99, *good[2:]],
        [good[0], "4", *good[2:]],
        good[:-1],
        [*good, 0],
        [PROTOCOL_VERSION],
        {"v": 1},
        "text",
    ):
        with pytest.raises(ProtocolError):
            decode_message(pack(bad))


def test_wrong_wire_types_are_rejected() -> None:
    # Every field on the wire, the optional ones too.
    good = wire(
        make_request(
            checksum=True,
            prefill_incarnation=1,
            decode_incarnation=1,
            mtp_layers=1,
            skip_pages=1,
            dst_page_ids=((5, 9),),
            nic_addresses=(b"nic1",),
            nic_descriptors=((b"a", b"b"),),
        )
    )
    names = [f.name for f in dataclasses.fields(PrefillRequest)]
    valid = [("request_id", "s"), ("context_descriptor", b"b"), ("source_sets", [1])]
    for index, name in enumerate(names, start=2):
        replacements: tuple[object, ...] = ("s", b"b", 1.5, None, [1], -1, {})
        for replacement in replacements:
            if replacement == good[index]:
                continue
            bad = list(good)
            bad[index] = replacement
            try:
                decode_message(pack(bad))
            except ProtocolError:
                continue
            # Only replacements that are valid values of the field may decode.
            assert (name, replacement) in valid, (name, replacement)


def test_ids_must_be_whole_uint32s() -> None:
    bad = wire(make_request())
    bad[4] = b"\x00\x01\x02"  # token_ids: not a multiple of 4 bytes
    with pytest.raises(ProtocolError, match="uint32"):
        decode_message(pack(bad))
    reason = wire(PrefillRejected("r", 1, RejectReason.TOO_LONG))
    reason[4] = 77
    with pytest.raises(ProtocolError, match="RejectReason"):
        decode_message(pack(reason))


def test_oversized_lists_are_rejected() -> None:
    bad = wire(make_request())
    page_lists = bad[6]
    assert isinstance(page_lists, list)
    bad[6] = [page_lists[0]] * (MAX_RANKS + 1)
    with pytest.raises(ProtocolError):
        decode_message(pack(bad))


def test_truncated_and_garbage_bytes_raise_protocol_error_only() -> None:
    data = encode_message(make_request())
    for end in range(len(data)):
        with pytest.raises(ProtocolError):
            decode_message(data[:end])
    rng = random.Random(7)
    for _ in range(2000):
        blob = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        with contextlib.suppress(ProtocolError):
            decode_message(blob)
    for _ in range(500):  # single-byte corruptions of a valid message
        corrupt = bytearray(data)
        corrupt[rng.randrange(len(corrupt))] = rng.randrange(256)
        with contextlib.suppress(ProtocolError):
            decode_message(bytes(corrupt))
    with pytest.raises(ProtocolError):
        decode_message("not bytes")  # type: ignore[arg-type]


def test_message_types_are_stable() -> None:
    # Wire numbers are part of the protocol: changing one needs a PROTOCOL_VERSION bump. Adding
    # a type (6: PrefillFailed) does not: an older peer drops it as unknown.
    assert PROTOCOL_VERSION == 1
    assert [int(t) for t in MessageType] == [1, 2, 3, 4, 5, 6]
    assert wire(AbortPrefill("r", 9)) == [1, 4, "r", 9]


# -- a detail is bounded in UTF-8 bytes, as the receiver's msgpack limit counts ------------------


@pytest.mark.parametrize("make", ["failed", "rejected"])
def test_a_multi_byte_detail_at_the_byte_limit_round_trips(make: str) -> None:
    detail = "x" + EURO * ((MAX_DETAIL_BYTES - 1) // 3)  # 342 chars, exactly the byte limit
    assert len(detail.encode()) == MAX_DETAIL_BYTES
    message = (
        PrefillFailed("r\u00e9", 7, FailReason.WRITE_ERROR, 12, detail)
        if make == "failed"
        else PrefillRejected("r\u00e9", 7, RejectReason.INTERNAL, detail)
    )
    assert decode_message(encode_message(message)) == message


@pytest.mark.parametrize("make", ["failed", "rejected"])
def test_a_detail_over_the_byte_limit_is_refused_at_encode_time(make: str) -> None:
    detail = "\ufffd" * 400  # 400 chars (well under 1024) but 1200 bytes
    with pytest.raises(ProtocolError, match="UTF-8 bytes"):
        if make == "failed":
            PrefillFailed("r1", 7, FailReason.WRITE_ERROR, 12, detail)
        else:
            PrefillRejected("r1", 7, RejectReason.INTERNAL, detail)


def test_a_detail_that_utf8_cannot_carry_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="UTF-8"):
        PrefillFailed("r1", 7, FailReason.INTERNAL, 0, "lone \udc80 surrogate")


def test_the_longest_request_id_fits_the_wire() -> None:
    longest = "\U0001f600" * MAX_ID_CHARS  # 4 bytes each: the most bytes an id can have
    message = PrefillFailed(longest, 1, FailReason.DEADLINE, 0)
    assert decode_message(encode_message(message)) == message


def test_truncate_detail_cuts_at_a_character_boundary() -> None:
    for prefix in ("", "x", "xy"):  # the cut falls after, inside, inside a 3-byte character
        cut = truncate_detail(prefix + EURO * 1000)
        assert len(cut.encode()) <= MAX_DETAIL_BYTES
        assert len(cut.encode()) > MAX_DETAIL_BYTES - 3
        assert cut == prefix + EURO * (len(cut) - len(prefix))
        message = PrefillFailed("r1", 1, FailReason.ENGINE_ERROR, 0, cut)
        assert decode_message(encode_message(message)) == message
    assert truncate_detail("short") == "short"
    assert truncate_detail("a \udc80 b") == "a ? b"


def test_messages_sealed_with_the_cluster_key_open_only_with_it() -> None:
    key, other = b"k" * 32, b"o" * 32
    message = make_request(checksum=True)
    sealed = encode_message(message, key)
    assert sealed[:-MAC_BYTES] == encode_message(message)  # the message, then its MAC
    assert decode_message(sealed, key) == message
    for data, opener in [
        (encode_message(message), key),  # no MAC
        (sealed, other),  # another cluster's
        (sealed[:-1] + bytes([sealed[-1] ^ 1]), key),  # MAC altered
        (bytes([sealed[0] ^ 1]) + sealed[1:], key),  # message altered
        (sealed[:MAC_BYTES], key),  # too short to hold a message
    ]:
        with pytest.raises(UnauthenticatedMessageError):
            decode_message(data, opener)
    with pytest.raises(ProtocolError):  # a sealed message read without the key: trailing bytes
        decode_message(sealed)
