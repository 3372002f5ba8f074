"""Request bytes at the client API's edge (`orchestrator.api.request_checks`), and the servicer
registered by `add_generation_servicer` on a real grpc.aio server (no Ray, no workers: a request
that passes the checks reaches the router and gets UNAVAILABLE)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor import Descriptor

from orchestrator.api.request_checks import MalformedRequest, checked_deserializer, unknown_fields
from orchestrator.api.servicer import GenerationServicer, add_generation_servicer
from orchestrator.config.sections import DEFAULT_MAX_REQUEST_BYTES, ConfigError
from orchestrator.control.registry import Registry
from orchestrator.errors import InvalidRequestError, UnavailableError
from orchestrator.router.core import GenerationInput, Router, RouterSettings
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import worker_pb2 as wpb
from tests.system.cluster_helpers import cluster_config, mixed_groups
from workers.engine.tokenizer import ByteTokenizer
from workers.kv.endpoint import PrefillEndpoint

LIMIT = 4096
GOOD = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=3))


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    """One protobuf field, encoded by hand (numbers and lengths below 128 here)."""
    assert number < 16 and len(payload) < 128
    key = bytes([number << 3 | wire_type])
    return key + (bytes([len(payload)]) + payload if wire_type == 2 else payload)


def _endpoint() -> bytes:
    return PrefillEndpoint(b"\x01" * 16, "tcp;ofi_rxm", 1, 3, False, 8, 16).to_bytes()


# Bytes no client built against generation.proto can send; each must be refused, never parsed.
MALFORMED = {
    "invalid UTF-8 in prompt": _field(2, 2, b"\xff\xfe"),
    "prompt with a varint wire type": _field(2, 0, b"\x05"),
    "truncated field": b"\x12\x10ab",
    "unknown field 99": GOOD.SerializeToString() + b"\x98\x06\x01",
    "worker sampling field (logprobs, 13) inside sampling": GOOD.SerializeToString()
    + _field(4, 2, wpb.WorkerSamplingParams(logprobs=True).SerializeToString()),
    "worker request with a prefill endpoint": wpb.WorkerGenerateRequest(
        request_id="r", prefill_endpoint=_endpoint()
    ).SerializeToString(),
    "prefill endpoint appended to a good request": GOOD.SerializeToString()
    + wpb.WorkerGenerateRequest(prefill_endpoint=_endpoint()).SerializeToString(),
    "unknown field 7 as a group": GOOD.SerializeToString() + b"\x3b\x3c",
    "field number 0": b"\x00\x01",
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_bytes_are_a_value_never_an_exception(name: str) -> None:
    result = checked_deserializer(pb.GenerateRequest, LIMIT)(MALFORMED[name])
    assert isinstance(result, MalformedRequest), name
    assert "pdserve.v1.GenerateRequest" in result.reason


def test_good_bytes_parse_and_reasons_name_the_problem() -> None:
    parse = checked_deserializer(pb.GenerateRequest, LIMIT)
    assert parse(GOOD.SerializeToString()) == GOOD
    assert parse(b"") == pb.GenerateRequest()  # empty is valid protobuf; the router rejects it
    bad_utf8 = parse(MALFORMED["invalid UTF-8 in prompt"])
    assert isinstance(bad_utf8, MalformedRequest) and "UTF-8" in bad_utf8.reason
    nested = parse(MALFORMED["worker sampling field (logprobs, 13) inside sampling"])
    assert isinstance(nested, MalformedRequest) and "sampling.13" in nested.reason
    top = parse(MALFORMED["unknown field 99"])
    assert isinstance(top, MalformedRequest) and "(numbers 99)" in top.reason


def test_size_limit_is_checked_on_the_raw_bytes() -> None:
    parse = checked_deserializer(pb.GenerateRequest, LIMIT)
    fits = pb.GenerateRequest(prompt="x" * (LIMIT - 3)).SerializeToString()
    assert len(fits) == LIMIT and isinstance(parse(fits), pb.GenerateRequest)
    over = pb.GenerateRequest(prompt="x" * (LIMIT - 2)).SerializeToString()
    result = parse(over)
    assert isinstance(result, MalformedRequest)
    assert f"{LIMIT + 1} bytes" in result.reason and "max_request_bytes" in result.reason


def test_unknown_fields_walks_every_set_message() -> None:
    message = pb.GenerateRequest.FromString(
        MALFORMED["unknown field 99"]
        + _field(4, 2, wpb.WorkerSamplingParams(logprobs=True).SerializeToString())
    )
    assert unknown_fields(message) == ["99", "sampling.13"]
    assert unknown_fields(GOOD) == []


def _client_messages() -> Iterator[Descriptor]:
    """Every message a client can send: the inputs of Generation's methods, recursively."""
    seen: set[str] = set()
    pending = [m.input_type for m in pb.DESCRIPTOR.services_by_name["Generation"].methods]
    while pending:
        message = pending.pop()
        if message.full_name in seen:
            continue
        seen.add(message.full_name)
        yield message
        pending.extend(f.message_type for f in message.fields if f.message_type is not None)


def test_no_client_field_can_steer_workers_or_kv_transfers() -> None:
    names = {m.full_name for m in _client_messages()}
    assert names == {
        "pdserve.v1.GenerateRequest",
        "pdserve.v1.SamplingParams",
        "pdserve.v1.GetModelInfoRequest",
        "pdserve.v1.GetClusterStateRequest",
        "pdserve.v1.ScaleGroupRequest",  # a group's size; never which worker serves what
    }
    words = ("descriptor", "page", "fabric", "transfer", "endpoint", "imm", "worker", "prefill")
    for message in _client_messages():
        for field in message.fields:
            assert not any(w in field.name for w in words), f"{message.full_name}.{field.name}"


# --- on a real grpc.aio server ---------------------------------------------------------------


def _servicer() -> GenerationServicer:
    settings = RouterSettings(
        serving_role="mixed",
        is_disaggregated=False,
        vocab_size=512,
        max_model_len=64,
        pool_tokens=1024,
        capacity_per_worker=4,
        max_queue=4,
        default_max_tokens=8,
        max_request_bytes=LIMIT,
    )
    router = Router(settings, Registry(), ByteTokenizer())  # no workers: valid → UNAVAILABLE
    return GenerationServicer(router, pb.GetModelInfoResponse(model_name="m"), [])


async def _code(channel: grpc.aio.Channel, method: str, data: bytes) -> grpc.StatusCode:
    call = channel.unary_stream(
        f"/pdserve.v1.Generation/{method}",
        request_serializer=None,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    try:
        async for _ in call(data, timeout=30):
            pass
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def test_the_registered_servicer_answers_bad_bytes_with_invalid_argument() -> None:
    async def run() -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 2 * LIMIT)])
        add_generation_servicer(_servicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                for name, data in MALFORMED.items():
                    code = await _code(channel, "Generate", data)
                    assert code == grpc.StatusCode.INVALID_ARGUMENT, name
                oversized = pb.GenerateRequest(prompt="x" * LIMIT).SerializeToString()
                assert await _code(channel, "Generate", oversized) == (
                    grpc.StatusCode.INVALID_ARGUMENT
                )
                beyond = pb.GenerateRequest(prompt="x" * 2 * LIMIT).SerializeToString()
                assert await _code(channel, "Generate", beyond) == (
                    grpc.StatusCode.RESOURCE_EXHAUSTED  # gRPC's own transport limit
                )
                # Good bytes pass the checks and reach the router, which has no worker.
                assert await _code(channel, "Generate", GOOD.SerializeToString()) == (
                    grpc.StatusCode.UNAVAILABLE
                )
                info = channel.unary_unary(
                    "/pdserve.v1.Generation/GetModelInfo",
                    request_serializer=None,
                    response_deserializer=pb.GetModelInfoResponse.FromString,
                )
                assert (await info(b"", timeout=30)).model_name == "m"
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await info(b"\x98\x06\x01", timeout=30)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "99" in (caught.value.details() or "")
        finally:
            await server.stop(None)

    asyncio.run(run())


# --- values the router refuses before any worker is involved ---------------------------------

BAD_INPUTS = {  # what the router is given -> what its error must say
    "max_tokens above max_model_len": (
        GenerationInput(prompt="hi", max_tokens=65),
        "max_tokens 65 exceeds max_model_len=64",
    ),
    "max_tokens int32 max": (
        GenerationInput(prompt="hi", max_tokens=2**31 - 1),
        "exceeds max_model_len",
    ),
    "prompt over max_request_bytes": (
        GenerationInput(prompt="é" * (LIMIT // 2 + 1)),  # two bytes each
        f"prompt of {LIMIT + 2} bytes exceeds",
    ),
    "lone surrogate in the prompt": (GenerationInput(prompt="a\ud800b"), "not valid Unicode"),
    "17 stop strings": (
        GenerationInput(prompt="hi", sampling={"stop": ["s"] * 17}),
        "at most 16 stop strings",
    ),
    "stop string of 257 bytes": (
        GenerationInput(prompt="hi", sampling={"stop": ["s" * 257]}),
        "at most 256 bytes",
    ),
    "lone surrogate in a stop string": (
        GenerationInput(prompt="hi", sampling={"stop": ["\udfff"]}),
        "not valid Unicode",
    ),
    "257 stop token ids": (
        GenerationInput(prompt="hi", sampling={"stop_token_ids": [1] * 257}),
        "at most 256 stop token ids",
    ),
    "negative seed": (GenerationInput(prompt="hi", sampling={"seed": -1}), "seed must be"),
    "seed of 2**64": (GenerationInput(prompt="hi", sampling={"seed": 2**64}), "seed must be"),
    "top_k beyond int32": (
        GenerationInput(prompt="hi", sampling={"top_k": 2**31}),
        "top_k must be",
    ),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_the_router_refuses_before_admission(name: str) -> None:
    router = _servicer().router  # no worker: anything admitted would be UNAVAILABLE instead
    request, message = BAD_INPUTS[name]

    async def run() -> None:
        with pytest.raises(InvalidRequestError, match=re.escape(message)):
            await anext(router.generate(request))
        assert router.num_outstanding == 0 and router.num_queued == 0

    asyncio.run(run())


def test_limits_at_their_edge_pass_validation() -> None:
    router = _servicer().router

    async def run() -> None:
        edge = GenerationInput(
            prompt="é" * (LIMIT // 2 - 100),  # within max_request_bytes, then too long: tokens
            max_tokens=64,
            sampling={"stop": ["s" * 256] * 16, "stop_token_ids": [1] * 256, "seed": 2**64 - 1},
        )
        with pytest.raises(InvalidRequestError, match="max_model_len"):  # the token count
            await anext(router.generate(edge))
        fits = GenerationInput(prompt="hi", max_tokens=64, sampling=edge.sampling)
        with pytest.raises(UnavailableError):  # valid: it got as far as admission
            await anext(router.generate(fits))

    asyncio.run(run())


# --- router.max_request_bytes in the configuration -------------------------------------------


def test_max_request_bytes_is_configured_with_units_and_checked(tiny_model_dir: Path) -> None:
    default = cluster_config(tiny_model_dir, mixed_groups(1))
    assert default.router.max_request_bytes == DEFAULT_MAX_REQUEST_BYTES == 4 * 2**20
    sized = cluster_config(tiny_model_dir, mixed_groups(1), router={"max_request_bytes": "1MiB"})
    assert sized.router.max_request_bytes == 2**20
    for bad, message in ((512, "must be >= 1024"), (2**31, "must be <= "), ("lots", "size")):
        with pytest.raises(ConfigError, match=message) as caught:
            cluster_config(tiny_model_dir, mixed_groups(1), router={"max_request_bytes": bad})
        assert caught.value.path == "router.max_request_bytes"
