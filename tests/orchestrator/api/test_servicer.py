"""The gRPC front's mapping: a `GenerateRequest` to the router's `GenerationInput` (field
presence kept), and the router's typed errors to status codes."""

from __future__ import annotations

import grpc
import pytest

from orchestrator.api.servicer import input_from_proto, status_of
from orchestrator.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    QueueFullError,
    UnavailableError,
    WorkerFailedError,
)
from protos.pdserve.v1 import generation_pb2 as pb


def test_input_from_proto_keeps_presence() -> None:
    unset = input_from_proto(pb.GenerateRequest(prompt="x"))
    assert unset.sampling == {} and unset.max_tokens is None
    given = input_from_proto(
        pb.GenerateRequest(
            prompt="x", sampling=pb.SamplingParams(temperature=0, max_tokens=3, seed=7)
        )
    )
    assert given.sampling["temperature"] == 0 and given.sampling["seed"] == 7
    assert given.max_tokens == 3
    with pytest.raises(InvalidRequestError):
        input_from_proto(pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(max_tokens=0)))


def test_status_mapping() -> None:
    assert status_of(InvalidRequestError()) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(QueueFullError()) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_of(UnavailableError()) == grpc.StatusCode.UNAVAILABLE
    assert status_of(WorkerFailedError()) == grpc.StatusCode.UNAVAILABLE
    assert status_of(DuplicateRequestError()) == grpc.StatusCode.ALREADY_EXISTS
    assert status_of(RuntimeError()) == grpc.StatusCode.INTERNAL
