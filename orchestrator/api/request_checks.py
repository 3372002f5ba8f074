"""The client API's request bytes → a message, or the reason they are not one.

gRPC turns an exception raised while deserializing a request into INTERNAL, which blames the
server for the client's bytes. `checked_deserializer` therefore never raises: it returns the
parsed message or a `MalformedRequest`, which `orchestrator.api.servicer` answers with
INVALID_ARGUMENT before any handler runs. Rejected here, in this order:

- a request larger than ``router.max_request_bytes``, before parsing anything (bytes beyond
  gRPC's own transport limit never get this far: gRPC answers RESOURCE_EXHAUSTED itself);
- bytes that are not the message: truncated or corrupt wire data, a string field that is not
  valid UTF-8 (protobuf checks this for proto3 strings);
- unknown fields, at any depth. A field of a known number sent with the wrong wire type is kept
  by protobuf as an unknown field too, so this also catches those. Ignoring unknown fields
  would silently serve a client built against another schema as if it had asked for the
  defaults, and would let fields that only the router sets (``worker.proto``'s
  ``prefill_endpoint``, the fabric's descriptors) reach the servicer as opaque bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class MalformedRequest:
    """Request bytes that are not a valid message of the method; ``reason`` says why."""

    reason: str


def unknown_fields(message: Message, path: str = "") -> list[str]:
    """Dotted paths of the unknown fields in ``message`` and every message set inside it, as
    ``name.number`` (``sampling.13``); empty when there are none."""
    found = sorted({f"{path}{field.field_number}" for field in UnknownFieldSet(message)}, key=_key)
    for descriptor, value in message.ListFields():
        if descriptor.message_type is None:
            continue
        children: Iterable[Message]
        if descriptor.message_type.GetOptions().map_entry:
            # Map values may be messages; keys never are.
            values = list(value.values())
            children = [v for v in values if isinstance(v, Message)]
        elif descriptor.is_repeated:
            children = value
        else:
            children = [value]
        for index, child in enumerate(children):
            where = f"{descriptor.name}[{index}]" if descriptor.is_repeated else descriptor.name
            found.extend(unknown_fields(child, f"{path}{where}."))
    return found


def _key(path: str) -> tuple[int, str]:
    number = path.rsplit(".", 1)[-1]
    return (int(number) if number.isdigit() else 0, path)


def checked_deserializer(
    message_type: type[M], max_bytes: int
) -> Callable[[bytes], M | MalformedRequest]:
    """A gRPC request deserializer for ``message_type`` that never raises (see the module)."""
    name = message_type.DESCRIPTOR.full_name

    def deserialize(data: bytes) -> M | MalformedRequest:
        if len(data) > max_bytes:
            return MalformedRequest(
                f"request of {len(data)} bytes exceeds the router's limit of {max_bytes} bytes "
                "(router.max_request_bytes)"
            )
        try:
            message = message_type.FromString(data)
        except Exception as error:  # DecodeError, or any other parse failure: the client's bytes
            return MalformedRequest(f"not a valid {name}: {error}")
        unknown = unknown_fields(message)
        if unknown:
            return MalformedRequest(
                f"{name} has unknown fields (numbers {', '.join(unknown)}): fields this API "
                "does not define, or defined ones sent with the wrong wire type; the router "
                "sets the fields of its own path to workers itself"
            )
        return message

    return deserialize
