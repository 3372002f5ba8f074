"""Checks shared by the mixed and disaggregated end-to-end tests (real Ray, real gRPC)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchestrator.api.client import pb, pb_grpc
from orchestrator.config.sections import DEFAULT_MAX_REQUEST_BYTES
from protos.pdserve.v1 import worker_pb2 as wpb
from tests.system.cluster_helpers import free_pages, pools_full
from tests.waiting import wait_until
from workers.engine.config import EngineConfig
from workers.engine.engine_core import EngineCore
from workers.engine.sampling_params import SamplingParams
from workers.engine.tokenizer import load_tokenizer
from workers.kv.endpoint import PrefillEndpoint

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived",
    "pdserve",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32",
    "a" * 70,
    "Hello, world!",
]


def colocated_outputs(
    model_dir: Path,
    prompts: list[str] | list[list[int]],
    max_tokens: int,
    ignore_eos: bool = False,
) -> list[list[int]]:
    """Greedy token ids of the colocated engine, one request at a time (text prompts are
    tokenized as the router does)."""
    import torch

    torch.set_num_threads(1)  # as the workers run
    engine = EngineCore(model_dir, EngineConfig(num_pages=64, max_model_len=256), detokenize=False)
    tokenizer = load_tokenizer(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    results = []
    for i, prompt in enumerate(prompts):
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        engine.add_request(f"ref-{i}", ids, params)
        tokens: list[int] = []
        while engine.has_unfinished():
            for output in engine.step():
                tokens.extend(output.new_token_ids)
        results.append(tokens)
    return results


def generate_all(address: str, prompts: list[str], max_tokens: int) -> list[Any]:
    def one(prompt: str) -> list[pb.GenerateResponse]:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(
                prompt=prompt,
                return_token_ids=True,
                sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens),
            )
            return list(stub.Generate(request, timeout=120))

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def check_parity(address: str, model_dir: Path) -> None:
    max_tokens = 12
    expected = colocated_outputs(model_dir, PROMPTS, max_tokens)
    tokenizer = load_tokenizer(model_dir)
    for prompt, want, responses in zip(
        PROMPTS, expected, generate_all(address, PROMPTS, max_tokens), strict=True
    ):
        got = [t for r in responses for t in r.token_ids]
        assert got == want, prompt
        last = responses[-1]
        assert last.finish_reason in ("length", "stop")
        assert last.usage.completion_tokens == len(want)
        assert last.usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert all(not r.finish_reason for r in responses[:-1])
        text = "".join(r.text for r in responses)
        assert text == tokenizer.decode(want)


BAD_REQUESTS = {
    "no prompt": pb.GenerateRequest(),
    "prompt and token ids": pb.GenerateRequest(prompt="x", prompt_token_ids=[1, 2]),
    "token id outside vocab": pb.GenerateRequest(prompt_token_ids=[1, 10**6]),
    "negative token id": pb.GenerateRequest(prompt_token_ids=[1, -3]),
    "prompt too long": pb.GenerateRequest(prompt_token_ids=[5] * 400),
    "negative temperature": pb.GenerateRequest(
        prompt="x", sampling=pb.SamplingParams(temperature=-1)
    ),
    "top_p zero": pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(top_p=0)),
    "top_p above one": pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(top_p=1.5)),
    "top_k below -1": pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(top_k=-2)),
    "min_p above one": pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(min_p=2)),
    "repetition_penalty zero": pb.GenerateRequest(
        prompt="x", sampling=pb.SamplingParams(repetition_penalty=0)
    ),
    "presence_penalty out of range": pb.GenerateRequest(
        prompt="x", sampling=pb.SamplingParams(presence_penalty=3)
    ),
    "frequency_penalty out of range": pb.GenerateRequest(
        prompt="x", sampling=pb.SamplingParams(frequency_penalty=-3)
    ),
    "max_tokens zero": pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(max_tokens=0)),
    "empty stop string": pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(stop=[""])),
    "stop token outside vocab": pb.GenerateRequest(
        prompt="x", sampling=pb.SamplingParams(stop_token_ids=[10**6])
    ),
    "max_tokens negative": pb.GenerateRequest(
        prompt="x", sampling=pb.SamplingParams(max_tokens=-5)
    ),
    "max_tokens above max_model_len": pb.GenerateRequest(
        prompt="x", sampling=pb.SamplingParams(max_tokens=257)
    ),
    "max_tokens huge": pb.GenerateRequest(
        prompt="x", sampling=pb.SamplingParams(max_tokens=2**31 - 1)
    ),
    "too many stop strings": pb.GenerateRequest(
        prompt="x", sampling=pb.SamplingParams(stop=[f"s{i}" for i in range(17)])
    ),
    "stop string too long": pb.GenerateRequest(
        prompt="x", sampling=pb.SamplingParams(stop=["s" * 257])
    ),
    "too many stop token ids": pb.GenerateRequest(
        prompt="x", sampling=pb.SamplingParams(stop_token_ids=[1] * 257)
    ),
}

_GOOD = pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(max_tokens=2))
_ENDPOINT = PrefillEndpoint(b"\x01" * 16, "tcp;ofi_rxm", 1, 3, False, 8, 16).to_bytes()


def _length_delimited(number: int, payload: bytes) -> bytes:
    assert number < 16 and len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


def raw_bad_requests(max_request_bytes: int) -> dict[str, bytes]:
    """Bytes no client built against generation.proto sends (see orchestrator.api.request_checks)."""
    good = _GOOD.SerializeToString()
    worker_sampling = wpb.WorkerSamplingParams(logprobs=True).SerializeToString()
    return {
        "invalid UTF-8 in the prompt": _length_delimited(2, b"\xff\xfe"),
        "prompt sent as a varint": b"\x10\x05",
        "unknown field 99": good + b"\x98\x06\x01",
        "worker-only sampling field": good + _length_delimited(4, worker_sampling),
        "prefill endpoint of the internal API": good
        + wpb.WorkerGenerateRequest(prefill_endpoint=_ENDPOINT).SerializeToString(),
        "over max_request_bytes": pb.GenerateRequest(
            prompt="x" * max_request_bytes
        ).SerializeToString(),
    }


def _raw_code(generate: Any, data: bytes) -> grpc.StatusCode:
    try:
        list(generate(data, timeout=60))
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def check_bad_requests(address: str, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
    """Every bad request is refused with its status, allocates nothing, and the router serves a
    good request afterwards (``max_request_bytes``: the cluster's router.max_request_bytes)."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        before = free_pages(stub, pb)
        for name, request in BAD_REQUESTS.items():
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request, timeout=30))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        # Hand-made bytes: what a stub built from generation.proto cannot send.
        generate = channel.unary_stream(
            "/pdserve.v1.Generation/Generate",
            request_serializer=None,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        for name, data in raw_bad_requests(max_request_bytes).items():
            assert _raw_code(generate, data) == grpc.StatusCode.INVALID_ARGUMENT, name
        # Beyond the transport limit (twice max_request_bytes) gRPC itself refuses it.
        beyond = pb.GenerateRequest(prompt="x" * (2 * max_request_bytes)).SerializeToString()
        assert _raw_code(generate, beyond) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert free_pages(stub, pb) == before  # nothing was allocated
        assert stub.GetClusterState(pb.GetClusterStateRequest()).num_outstanding_requests == 0
        check_duplicate_request_id(stub)
        wait_until(lambda: free_pages(stub, pb) == before, what="pages of the first request freed")
        answer = list(stub.Generate(_GOOD, timeout=60))  # still healthy
        assert answer[-1].finish_reason in ("length", "stop")


def check_duplicate_request_id(stub: Any) -> None:
    """A second request with the id of one in flight: ALREADY_EXISTS, and the first completes."""
    request = pb.GenerateRequest(
        request_id="dup",
        prompt="count with me:",
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True),
    )
    first = stub.Generate(request, timeout=120)
    responses = [next(first)]  # the router holds "dup" from before its first token
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert stub.GetClusterState(pb.GetClusterStateRequest()).num_outstanding_requests == 1
    responses.extend(first)
    assert responses[-1].finish_reason == "length"
    assert responses[-1].usage.completion_tokens == 200


def long_request(request_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt="tell me a long story " * 4,
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True),
    )


def check_cancel_and_deadline(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        # Cancel after the first tokens: the worker aborts, its pages come back.
        calls = [stub.Generate(long_request(f"cancel-{i}"), timeout=120) for i in range(3)]
        for call in calls:
            next(call)
        for call in calls:
            call.cancel()
        wait_until(lambda: pools_full(stub, pb), what="pages freed after cancel")
        # A deadline that passes mid-stream. How long a whole answer takes depends on the machine,
        # on speculation and on the prefix cache (this prompt is cached by now), so the deadline
        # is a quarter of what a whole answer just took, and at most 0.3 s.
        started = time.monotonic()
        responses = list(stub.Generate(long_request("whole"), timeout=120))
        assert responses[-1].finish_reason == "length"
        deadline = min(0.3, (time.monotonic() - started) / 4)
        with pytest.raises(grpc.RpcError) as info:
            for _ in stub.Generate(long_request("deadline"), timeout=deadline):
                pass
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: pools_full(stub, pb), what="pages freed after the deadline")
        wait_until(
            lambda: stub.GetClusterState(pb.GetClusterStateRequest()).num_outstanding_requests == 0,
            what="router forgot the requests",
        )


def greedy_reference(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy token ids of the colocated engine (ignore_eos, as the requests)."""
    return colocated_outputs(model_dir, prompts, max_tokens, ignore_eos=True)


def greedy_request(request_id: str, prompt: list[int], max_tokens: int) -> pb.GenerateRequest:
    """A greedy request of ``max_tokens`` tokens exactly (ignore_eos) that returns its ids."""
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        return_token_ids=True,
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )
