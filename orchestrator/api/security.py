"""TLS, mTLS and bearer-token auth of the router's two fronts (gRPC and OpenAI HTTP), server and
client side.

Server: `load_server_tls` reads ``router.tls`` once at start-up and returns the credentials of
both fronts (`ServerTLS`); ``ca`` set means mutual TLS (a client certificate signed by it is
required). `workers.token_auth.TokenAuthInterceptor` rejects gRPC calls without ``authorization:
Bearer <token>`` metadata with UNAUTHENTICATED; ``grpc.health.v1.Health`` stays open, as
``/health`` does on HTTP (`orchestrator.api.http`), so that load balancers and probes need no
secret.

Client: `channel_credentials` (root CA, optional client certificate) and `token_metadata` /
`token_interceptors` for the token (`orchestrator.api.client.channel` puts them together).

Unreadable or malformed files fail with `TLSFileError`, naming the setting and the file, before
anything listens.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from orchestrator.config.sections import ConfigError, TLSConfig
from workers.token_auth import AUTH_METADATA_KEY


class TLSFileError(ConfigError):
    """A certificate or key file that cannot be read or used; ``path`` names the setting."""


# --- files ----------------------------------------------------------------------------------


def read_pem(setting: str, file: Path) -> bytes:
    """The bytes of a PEM file, or `TLSFileError` naming ``setting`` and ``file``."""
    try:
        data = file.read_bytes()
    except OSError as error:
        raise TLSFileError(setting, f"cannot read {file}: {error.strerror or error}") from None
    if b"-----BEGIN " not in data:
        raise TLSFileError(setting, f"{file} is not a PEM file (no '-----BEGIN' line)")
    return data


# --- server side ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerTLS:
    """The router's TLS, loaded: credentials for the gRPC server and the aiohttp site."""

    grpc_credentials: Any  # grpc.ServerCredentials
    ssl_context: ssl.SSLContext = field(repr=False)
    requires_client_cert: bool

    @property
    def mode(self) -> str:
        return "mTLS" if self.requires_client_cert else "TLS"


def load_server_tls(tls: TLSConfig, section: str = "router.tls") -> ServerTLS:
    """Read ``tls`` (which must be enabled) into the credentials of both fronts."""
    if tls.cert is None or tls.key is None:
        raise TLSFileError(section, "TLS is not enabled (cert and key are unset)")
    cert = read_pem(f"{section}.cert", tls.cert)
    key = read_pem(f"{section}.key", tls.key)
    ca = read_pem(f"{section}.ca", tls.ca) if tls.ca is not None else None
    context = server_ssl_context(tls.cert, tls.key, tls.ca, section)
    credentials = grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )
    return ServerTLS(credentials, context, requires_client_cert=ca is not None)


def server_ssl_context(
    cert: Path, key: Path, ca: Path | None, section: str = "router.tls"
) -> ssl.SSLContext:
    """An `ssl.SSLContext` for the HTTP front; with ``ca``, client certificates signed by it are
    required. Loading it also proves that cert and key belong together (gRPC would only find
    out at the first handshake)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        # An empty password: an encrypted key fails here instead of OpenSSL prompting on the
        # terminal of a server (gRPC cannot use encrypted keys either).
        context.load_cert_chain(cert, key, password=b"")
    except ssl.SSLError as error:
        raise TLSFileError(
            section,
            f"cert {cert} and key {key} cannot be used together (not a pair, or an encrypted "
            f"key): {error.reason or error}",
        ) from None
    if ca is not None:
        try:
            context.load_verify_locations(cafile=ca)
        except ssl.SSLError as error:
            raise TLSFileError(f"{section}.ca", f"{ca}: {error.reason or error}") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


# --- client side ----------------------------------------------------------------------------


def channel_credentials(
    ca: Path | None = None, cert: Path | None = None, key: Path | None = None
) -> Any:
    """`grpc.ChannelCredentials` trusting ``ca`` (None: the system's roots), presenting the
    client certificate ``cert`` / ``key`` when given (both or neither)."""
    if (cert is None) != (key is None):
        missing = "--tls-key" if key is None else "--tls-cert"
        raise TLSFileError(missing, "a client certificate needs both --tls-cert and --tls-key")
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem("--tls-ca", ca) if ca is not None else None,
        private_key=read_pem("--tls-key", key) if key is not None else None,
        certificate_chain=read_pem("--tls-cert", cert) if cert is not None else None,
    )


def token_metadata(token: str) -> tuple[tuple[str, str]]:
    """The call metadata carrying ``token``, for stubs called with ``metadata=``."""
    return ((AUTH_METADATA_KEY, f"Bearer {token}"),)


class _TokenMetadata:
    """Adds the bearer token to a call's metadata. Metadata rather than
    `grpc.access_token_call_credentials`, which gRPC refuses on a plaintext channel (a token
    without TLS is a supported, if weaker, setup on a trusted network)."""

    def __init__(self, token: str) -> None:
        self._metadata = token_metadata(token)

    def _with_token(self, details: Any) -> Any:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._metadata)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


class _UnaryUnaryToken(_TokenMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        return await continuation(self._with_token(details), request)


class _UnaryStreamToken(_TokenMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        return await continuation(self._with_token(details), request)


class _StreamUnaryToken(_TokenMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self, continuation: Callable[..., Any], details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(self._with_token(details), request_iterator)


class _StreamStreamToken(_TokenMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self, continuation: Callable[..., Any], details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(self._with_token(details), request_iterator)


def token_interceptors(token: str) -> list[Any]:
    """Interceptors that send ``token`` on every call of an asyncio channel. One per call shape:
    a `grpc.aio` channel files each interceptor under the first shape it implements only."""
    shapes = (_UnaryUnaryToken, _UnaryStreamToken, _StreamUnaryToken, _StreamStreamToken)
    return [shape(token) for shape in shapes]
