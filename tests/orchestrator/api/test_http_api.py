"""The OpenAI-compatible HTTP front, end to end: the official ``openai`` client against a served
mixed cluster (real Ray, real workers), compared with the gRPC path of the same router."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from orchestrator.api.client import pb, pb_grpc
from orchestrator.api.http import HttpSettings, OpenAIHttpApi
from tests.system.cluster_helpers import ServedCluster, cluster_config, mixed_groups, pools_full
from workers.engine.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 256  # cluster_helpers.cluster_config's
PROMPT = "Once upon a time, in a land far away, there lived"
MESSAGES: list[Any] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


@pytest.fixture(scope="module")
def cluster(ray_local: None, tiny_model_dir: Path) -> Iterator[ServedCluster]:
    served = ServedCluster(cluster_config(tiny_model_dir, mixed_groups(1)))
    try:
        yield served
    finally:
        served.close()


@pytest.fixture(scope="module")
def client(cluster: ServedCluster) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://{cluster.app.http_address}/v1", api_key="none", max_retries=0
    )


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    (entry,) = client.models.list().data
    return entry.id


def grpc_text(address: str, max_tokens: int, **prompt: Any) -> str:
    with grpc.insecure_channel(address) as channel:
        request = pb.GenerateRequest(
            sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens), **prompt
        )
        return "".join(r.text for r in pb_grpc.GenerationStub(channel).Generate(request))


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    return urllib.request.urlopen(request, timeout=60)


def test_models_and_health(cluster: ServedCluster, model: str, tiny_model_dir: Path) -> None:
    assert model == tiny_model_dir.name
    with urllib.request.urlopen(f"http://{cluster.app.http_address}/health") as reply:
        assert reply.status == 200 and json.load(reply) == {"status": "ok"}


def test_completion_matches_grpc(
    cluster: ServedCluster, client: openai.OpenAI, model: str, tiny_model_dir: Path
) -> None:
    expected = grpc_text(cluster.address, 12, prompt=PROMPT)
    result = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    (choice,) = result.choices
    assert choice.text == expected
    assert choice.finish_reason in ("length", "stop")
    assert result.usage is not None
    assert result.usage.prompt_tokens == len(load_tokenizer(tiny_model_dir).encode(PROMPT))
    assert 0 < result.usage.completion_tokens <= 12
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens


def test_streamed_completion_with_usage(
    cluster: ServedCluster, client: openai.OpenAI, model: str
) -> None:
    expected = grpc_text(cluster.address, 12, prompt=PROMPT)
    chunks = list(
        client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *text_chunks, last = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == expected
    assert text_chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert last.choices == [] and last.usage is not None
    assert 0 < last.usage.completion_tokens <= 12


def test_chat_matches_grpc_with_the_template(
    cluster: ServedCluster, client: openai.OpenAI, model: str, tiny_model_dir: Path
) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False)
    expected = grpc_text(cluster.address, 10, prompt_token_ids=ids)
    result = client.chat.completions.create(
        model=model, messages=MESSAGES, max_completion_tokens=10, temperature=0
    )
    (choice,) = result.choices
    assert choice.message.role == "assistant" and choice.message.content == expected
    assert result.usage is not None and result.usage.prompt_tokens == len(ids)
    streamed = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected


def test_raw_sse_ends_with_done(cluster: ServedCluster, model: str) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with post(f"http://{cluster.app.http_address}/v1/completions", body) as reply:
        assert reply.headers["Content-Type"].startswith("text/event-stream")
        events = [line for line in reply.read().decode().split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    usage = json.loads(events[-2].removeprefix("data: "))
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0


def test_logprobs_of_the_chosen_tokens(client: openai.OpenAI, model: str) -> None:
    result = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1
    )
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert len(logprobs.token_logprobs) == result.usage.completion_tokens  # type: ignore[union-attr]
    assert all(v <= 0 for v in logprobs.token_logprobs)


@pytest.mark.parametrize(
    "fields",
    [
        {"prompt": "x" * 300},  # context overflow: max_model_len is 256
        {"prompt": ""},
        {"prompt": "hi", "n": 2},
        {"prompt": "hi", "temperature": -1},
        {"prompt": "hi", "max_tokens": 0},
        {"prompt": "hi", "stop": 3},
        {"prompt": ["a", "b"]},
        {"prompt": [1, 10**6]},  # a token id outside the vocabulary
        {"prompt": "hi", "top_p": 1.5},
        {"prompt": "hi", "max_tokens": 10**9},  # more than max_model_len
        {"prompt": "hi", "stop": [f"s{i}" for i in range(17)]},
        {"prompt": "hi", "stop": "s" * 257},
        {"prompt": "hi", "seed": -1},
        {"prompt": "hi", "top_k": 2**40},
        {"prompt": "hi", "kv_transfer_params": {"do_remote_prefill": True}},
        {"prompt": "hi", "prefill_endpoint": "10.0.0.1:5000"},
    ],
)
def test_bad_requests_are_400(client: openai.OpenAI, model: str, fields: dict[str, Any]) -> None:
    prompt = fields.pop("prompt")
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt=prompt, extra_body=fields)
    assert caught.value.status_code == 400
    body = caught.value.body
    assert isinstance(body, dict)
    error = body.get("error", body)  # the whole JSON or its "error" (client versions differ)
    assert error["type"] == "invalid_request_error" and error["message"]


def test_bad_chat_and_unknown_model(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[])
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi")


def test_bearer_token(cluster: ServedCluster, model: str) -> None:
    # The cluster's own router behind a second front that requires a token.
    api = OpenAIHttpApi(cluster.app.router, HttpSettings(model, auth_token="s3cret"))
    address = cluster.run(api.start("127.0.0.1", 0))
    try:
        base = f"http://{address}/v1"
        body = {"model": model, "prompt": "hi", "max_tokens": 2}
        with pytest.raises(urllib.error.HTTPError) as caught:
            post(f"{base}/completions", body)
        assert caught.value.code == 401
        assert json.load(caught.value)["error"]["code"] == "invalid_api_key"
        wrong = openai.OpenAI(base_url=base, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        right = openai.OpenAI(base_url=base, api_key="s3cret", max_retries=0)
        assert right.completions.create(model=model, prompt="hi", max_tokens=2).choices
        with urllib.request.urlopen(f"http://{address}/health") as reply:  # exempt
            assert reply.status == 200
    finally:
        cluster.run(api.stop())


def post_raw(url: str, data: bytes) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def test_bad_bytes_and_sizes_are_400_and_allocate_nothing(
    cluster: ServedCluster, model: str
) -> None:
    url = f"http://{cluster.app.http_address}/v1/completions"
    chat_url = f"http://{cluster.app.http_address}/v1/chat/completions"
    limit = cluster.app.router.settings.max_request_bytes
    cases = {
        "invalid UTF-8": (url, b'{"prompt": "\xff\xfe", "max_tokens": 2}'),
        "lone surrogate in the prompt": (url, b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
        "lone surrogate in a message": (
            chat_url,
            b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}',
        ),
        "body over max_request_bytes": (
            url,
            json.dumps({"model": model, "prompt": "x" * limit}).encode(),
        ),
    }
    for name, (where, data) in cases.items():
        status, body = post_raw(where, data)
        assert status == 400, name
        assert body["error"]["type"] == "invalid_request_error", name
    status, body = post_raw(url, cases["body over max_request_bytes"][1])
    assert body["error"]["code"] == "request_too_large" and str(limit) in body["error"]["message"]
    with grpc.insecure_channel(cluster.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        assert pools_full(stub, pb)
        assert stub.GetClusterState(pb.GetClusterStateRequest()).num_outstanding_requests == 0
    # Optional OpenAI keys this server does not use are ignored, not refused.
    extra = {"user": "u1", "logit_bias": {}, "stream_options": None, "max_tokens": 2}
    status, body = post_raw(url, json.dumps({"model": model, "prompt": "hi", **extra}).encode())
    assert status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop")


# --- OpenAI's errors and limits over HTTP -------------------------------------------------------


def request(url: str, body: dict[str, Any] | None = None, method: str = "POST") -> Any:
    """(status, headers, JSON body) of one request, errors included."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as reply:
            return reply.status, reply.headers, json.load(reply)
    except urllib.error.HTTPError as error:
        return error.code, error.headers, json.load(error)


def error_field(error: openai.APIStatusError) -> dict[str, Any]:
    body = error.body
    assert isinstance(body, dict)
    found: dict[str, Any] = body.get("error", body)  # client versions differ
    return found


@pytest.mark.slow
def test_explicit_max_tokens_past_the_context_is_context_length_exceeded(
    cluster: ServedCluster, client: openai.OpenAI, model: str
) -> None:
    prompt = [97] * 250  # token ids: 250 + 10 > 256
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt=prompt, max_tokens=10)
    error = error_field(caught.value)
    assert error["code"] == "context_length_exceeded"
    assert str(MAX_MODEL_LEN) in error["message"] and "260" in error["message"]
    messages: Any = [{"role": "user", "content": "a" * 240}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=messages, max_completion_tokens=50)
    assert error_field(caught.value)["code"] == "context_length_exceeded"
    # Without max_tokens the answer may use the rest of the context.
    served = client.completions.create(model=model, prompt=prompt, temperature=0)
    assert served.choices[0].finish_reason in ("length", "stop")
    # gRPC keeps serving the excess, ending with "length" at max_model_len.
    with grpc.insecure_channel(cluster.address) as channel:
        sampling = pb.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        replies = list(
            pb_grpc.GenerationStub(channel).Generate(
                pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)
            )
        )
    assert replies[-1].finish_reason == "length"
    assert replies[-1].usage.completion_tokens == MAX_MODEL_LEN - len(prompt)


@pytest.mark.slow
def test_unsupported_parameters_over_http(client: openai.OpenAI, model: str) -> None:
    messages: Any = [{"role": "user", "content": "hi"}]
    tools: Any = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=messages, tools=tools)
    assert error_field(caught.value)["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt="hi", suffix="!", max_tokens=2)
    assert error_field(caught.value)["param"] == "suffix"


@pytest.mark.slow
def test_served_completion_logprobs(client: openai.OpenAI, model: str) -> None:
    result = client.completions.create(
        model=model, prompt="Once upon", max_tokens=8, temperature=0, logprobs=1
    )
    choice = result.choices[0]
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs
    assert logprobs.text_offset is not None and logprobs.top_logprobs is not None
    assert len(logprobs.text_offset) == len(logprobs.tokens) == len(logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    assert logprobs.text_offset[-1] <= len(choice.text)
    for token, value, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert top[token] == value


@pytest.mark.slow
def test_unknown_paths_methods_and_models_are_openai_errors(
    cluster: ServedCluster, client: openai.OpenAI, model: str
) -> None:
    base = f"http://{cluster.app.http_address}"
    status, _, body = request(f"{base}/v1/embeddings", {"input": "hi"})
    assert status == 404 and body["error"]["code"] == "not_found"
    assert "/v1/embeddings" in body["error"]["message"]
    status, headers, body = request(f"{base}/v1/completions", method="GET")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
    assert "POST" in headers["Allow"]
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    status, _, body = request(f"{base}/v1/models/org/no-such-model", method="GET")
    assert status == 404 and body["error"]["code"] == "model_not_found"


def raw_status(address: str, authorization: bytes) -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: "
            + authorization
            + b"\r\nConnection: close\r\n\r\n"
        )
        return conn.makefile("rb").readline().strip()


@pytest.mark.slow
def test_a_non_utf8_authorization_header_is_401(cluster: ServedCluster, model: str) -> None:
    api = OpenAIHttpApi(cluster.app.router, HttpSettings(model, auth_token="s3cret"))
    address = cluster.run(api.start("127.0.0.1", 0))
    try:
        assert raw_status(address, b"Bearer \xff\xfe") == b"HTTP/1.1 401 Unauthorized"
        assert raw_status(address, b"Bearer s3cret") == b"HTTP/1.1 200 OK"
    finally:
        cluster.run(api.stop())
