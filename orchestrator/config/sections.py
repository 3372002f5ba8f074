"""The sections of the cluster configuration (`orchestrator.config`), one frozen dataclass
each, and `ConfigError`.

Each section checks its own fields in ``__post_init__`` and names them relative to itself
(``tp``); the parser in `orchestrator.config` places the error under the section's path
(``groups.decode.tp``). Rules across sections live in `orchestrator.config.ClusterConfig`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

GROUP_ROLES: tuple[str, ...] = ("prefill", "decode", "mixed")
# libfabric providers the KV transfer is written for (shared/design/DESIGN.md §5).
FABRIC_PROVIDERS: tuple[str, ...] = ("tcp;ofi_rxm", "shm", "verbs;ofi_rxm", "efa")
# Short names accepted for convenience, as in `workers.fabric.providers`.
FABRIC_PROVIDER_ALIASES: dict[str, str] = {"tcp": "tcp;ofi_rxm", "verbs": "verbs;ofi_rxm"}
ROUTING_POLICIES: tuple[str, ...] = ("least_outstanding", "round_robin", "random")
# Bind addresses that mean "every interface": no peer can dial them.
WILDCARD_HOSTS: frozenset[str] = frozenset({"0.0.0.0", "::"})
# The loopback addresses `localhost` resolves to (either or both): binding it takes them.
LOOPBACK_HOSTS: frozenset[str] = frozenset({"127.0.0.1", "::1"})
# router.max_request_bytes: gRPC's own default receive limit, so nothing that fit before is
# refused; room for a 128k-token prompt as token ids (at most 5 bytes each) or as text.
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
# The gRPC transport limit is twice router.max_request_bytes and gRPC takes an int32.
MAX_REQUEST_BYTES_LIMIT = 2**30


class ConfigError(ValueError):
    """A cluster configuration that cannot be served, with the dotted path of the bad key."""

    def __init__(self, path: str, message: str, source: str | Path | None = None) -> None:
        self.path = path
        self.message = message
        self.source = source
        prefix = "".join(f"{part}: " for part in (source, path) if part)
        super().__init__(prefix + message)

    def under(self, prefix: str) -> ConfigError:
        """The same error, its path placed under ``prefix`` (a section's own path)."""
        return ConfigError(join_path(prefix, self.path), self.message, self.source)


# --- value checks (raise with the field's name; parents prefix their own path) --------------


def join_path(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def check_int(
    name: str, value: object, minimum: int | None = None, maximum: int | None = None
) -> None:
    # bool is an int subclass; `tp: true` is a mistake, not 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(name, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(name, f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ConfigError(name, f"must be <= {maximum}, got {value}")


def check_optional_int(name: str, value: object, minimum: int) -> None:
    if value is not None:
        check_int(name, value, minimum)


def check_number(name: str, value: object, minimum: float, *, strict: bool = False) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ConfigError(name, f"must be a finite number, got {value!r}")
    if value < minimum or (strict and value == minimum):
        raise ConfigError(name, f"must be {'>' if strict else '>='} {minimum}, got {value}")


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(name, f"must be true or false, got {value!r}")


def check_choice(name: str, value: object, choices: Iterable[str]) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise ConfigError(name, f"must be one of {', '.join(choices)}; got {value!r}")


def check_optional_str(name: str, value: object) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(name, f"must be a non-empty string or null, got {value!r}")


def check_host(name: str, value: object) -> None:
    """A host to bind (a name or an IP address, no port): ``127.0.0.1``, ``0.0.0.0``, ``::``."""
    if (
        not isinstance(value, str)
        or not value
        or any(ch.isspace() or ch in "[]/" for ch in value)
        or (value.count(":") == 1)  # IPv6 has two or more; one means host:port
    ):
        raise ConfigError(name, f"must be a host name or IP address without a port, got {value!r}")


# --- sections -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """Engine limits of every worker (top-level ``limits``) or of one group (merged).

    max_model_len: prompt + output tokens per request; None means the model's own limit.
    num_pages / kv_memory_bytes: the KV pool of each rank, allocated up front; at most one.
    max_num_batched_tokens: tokens of one engine step; a multiple of ``page_size`` so that
        prefill chunks end on page boundaries (each page then moves in whole writes).
    """

    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    num_pages: int | None = None
    kv_memory_bytes: int | None = None
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        check_optional_int("max_model_len", self.max_model_len, 2)
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_optional_int("num_pages", self.num_pages, 1)
        check_optional_int("kv_memory_bytes", self.kv_memory_bytes, 1)
        check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        if self.num_pages is not None and self.kv_memory_bytes is not None:
            raise ConfigError("num_pages", "give num_pages or kv_memory_bytes, not both")
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ConfigError(
                "max_num_batched_tokens",
                f"without chunked prefill it must be >= max_model_len ({self.max_model_len}), "
                f"got {self.max_num_batched_tokens}: longer prompts could never run",
            )


@dataclass(frozen=True)
class Resources:
    """What Ray reserves for each rank: one placement-group bundle.

    memory: bytes, or None to reserve none. custom: Ray custom resources (``(name, amount)``
    pairs, e.g. to pin a group to nodes that advertise ``prefill_node``).
    """

    cpu: float = 1.0
    gpu: float = 0.0
    memory: int | None = None
    custom: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        check_number("cpu", self.cpu, 0)
        check_number("gpu", self.gpu, 0)
        check_optional_int("memory", self.memory, 1)
        for name, amount in self.custom:
            if not isinstance(name, str) or not name or name in ("CPU", "GPU", "memory"):
                raise ConfigError("custom", f"bad resource name {name!r}")
            check_number(f"custom.{name}", amount, 0, strict=True)
        if not self.bundle():
            # Ray refuses a bundle of zero resources.
            raise ConfigError("", "asks for nothing; give cpu, gpu, memory or a custom resource")

    def bundle(self) -> dict[str, float]:
        """The Ray placement-group bundle of one rank (zero amounts left out, as Ray wants)."""
        amounts: dict[str, float] = {"CPU": self.cpu, "GPU": self.gpu}
        if self.memory is not None:
            amounts["memory"] = self.memory
        amounts.update(self.custom)
        return {name: amount for name, amount in amounts.items() if amount > 0}


@dataclass(frozen=True)
class FabricConfig:
    """How a prefill or decode group's KV moves.

    node: address (or host name) the transfer engine binds to; None lets the provider pick the
    first suitable interface, which is what a multi-host cluster wants. Local configs give
    127.0.0.1, because ``tcp;ofi_rxm`` otherwise binds the first Ethernet interface.
    """

    provider: str = "tcp;ofi_rxm"
    node: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.provider, str):
            # Canonical layered name, so that peers compare providers as plain strings.
            provider = FABRIC_PROVIDER_ALIASES.get(self.provider, self.provider)
            object.__setattr__(self, "provider", provider)
        check_choice("provider", self.provider, FABRIC_PROVIDERS)
        check_optional_str("node", self.node)


@dataclass(frozen=True)
class GroupConfig:
    """``replicas`` identical workers of one role, each a TP group of ``tp`` ranks."""

    role: str
    replicas: int = 1
    tp: int = 1
    resources_per_rank: Resources = field(default_factory=Resources)
    # Required for prefill and decode (the parser fills in the default); absent for mixed.
    fabric: FabricConfig | None = None
    limits: Limits = field(default_factory=Limits)
    # CPU priority of the group's worker processes (Linux nice, 0 = normal, 19 = lowest). Where
    # roles share a host's CPUs (no accelerator, or the local 1:N setups), a prefill group at a
    # higher nice keeps long prompt chunks from delaying the latency-critical decode steps; on
    # separate machines it does nothing. Only lowering is allowed: raising needs privileges.
    nice: int = 0
    # Intra-op (torch / OpenMP) threads of each rank's process.
    threads: int = 1

    def __post_init__(self) -> None:
        check_choice("role", self.role, GROUP_ROLES)
        check_int("replicas", self.replicas, 1)
        check_int("tp", self.tp, 1)
        check_int("nice", self.nice, 0, 19)
        check_int("threads", self.threads, 1)
        if self.role == "mixed" and self.fabric is not None:
            raise ConfigError("fabric", "mixed workers move no KV between workers; remove it")
        if self.role != "mixed" and self.fabric is None:
            raise ConfigError("fabric", f"required for a {self.role} group")

    @property
    def num_ranks(self) -> int:
        return self.replicas * self.tp


@dataclass(frozen=True)
class TransferConfig:
    """KV transfers between prefill and decode workers.

    deadline_seconds: a decoder fails a request whose KV has not fully arrived by then.
    drain_interval_seconds: how often a decoder re-sends AbortPrefill for a failed transfer
        whose pages are quarantined (and checks whether its prefill process is gone). Pages
        are freed only once no write can land in them (acknowledged writes landed, or the
        prefill process gone), never after a time: a late write can never land in a page given
        to a newer request (`workers.kv.quarantine`).
    liveness_interval_seconds: how often a decoder checks the prefill worker of a transfer that
        had no write land since the last check (the fabric's failure record; on tcp a connect
        to its listener). A gone one (killed, crashed) fails its transfers at once, so the
        router retries them on another prefill worker instead of at the deadline. 0: off.
    coalesce_pages: merge writes of adjacent pages (both sides must agree: it is sent along).
    checksum: decoders verify every transfer's KV against checksums the prefill worker sends in
        the context write (`workers.kv.checksum`); a mismatch fails the request. Off by default:
        it costs a CRC-32 pass over the KV on both sides. Decoders ask for it per request.
    """

    deadline_seconds: float = 30.0
    drain_interval_seconds: float = 5.0
    liveness_interval_seconds: float = 1.0
    coalesce_pages: bool = True
    checksum: bool = False

    def __post_init__(self) -> None:
        check_number("deadline_seconds", self.deadline_seconds, 0, strict=True)
        check_number("drain_interval_seconds", self.drain_interval_seconds, 0)
        check_number("liveness_interval_seconds", self.liveness_interval_seconds, 0)
        check_bool("coalesce_pages", self.coalesce_pages)
        check_bool("checksum", self.checksum)


@dataclass(frozen=True)
class AuthConfig:
    """A bearer token every client must send: ``Authorization: Bearer <token>`` on HTTP (else
    401), ``authorization: Bearer <token>`` metadata on gRPC (else UNAUTHENTICATED). Health
    checks are exempt (``/health``, ``grpc.health.v1.Health``). None disables auth. Checked by
    `orchestrator.security` and `orchestrator.http_api`. The YAML may name a file holding it
    instead (``token_file``, read by `orchestrator.config` at load)."""

    # Out of repr: configs get logged, secrets must not be.
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_optional_str("token", self.token)


@dataclass(frozen=True)
class TLSConfig:
    """TLS of both router fronts (gRPC and HTTP), PEM files. cert + key turn TLS on; ca in
    addition requires client certificates signed by it (mTLS). The router reads and checks the
    files when it starts (`orchestrator.security.load_server_tls`), before placing workers."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigError("cert" if self.cert is None else "key", "cert and key go together")
        if self.ca is not None and self.cert is None:
            raise ConfigError("ca", "client verification needs the server's own cert and key")

    @property
    def enabled(self) -> bool:
        return self.cert is not None


@dataclass(frozen=True)
class RouterConfig:
    """The front doors: gRPC, and the OpenAI-compatible HTTP API (`orchestrator.http_api`).

    address: gRPC ``host:port`` to listen on (port 0: any free port).
    http_address: HTTP ``host:port`` of ``/v1/completions``, ``/v1/chat/completions``,
        ``/v1/models`` and ``/health``; None serves no HTTP.
    max_queue: requests held while no decode worker has room; more get RESOURCE_EXHAUSTED.
    default_max_tokens: for requests that leave ``max_tokens`` unset.
    grace_seconds: how long a stopping router lets streams finish.
    max_request_bytes: largest request accepted, as serialized protobuf (gRPC) or as the JSON
        body (HTTP); larger ones get INVALID_ARGUMENT / HTTP 400 before they are parsed. The
        gRPC server's transport limit is twice this: beyond it gRPC itself answers
        RESOURCE_EXHAUSTED without reading the message.
    prefill_retries: disaggregated only: how many other prefill workers a request tries when
        its KV transfer failed before any token was streamed (prefill dead, stalled past the
        transfer deadline, or refusing it); 0 fails the request at once.
    worker_retries: how many other decode (or mixed) workers a request tries when its worker
        was lost before any token was streamed (it died, failed its health check, or refused
        the request as unavailable: draining, closing, KV fabric unusable); 0 fails it at once.
    local_prefill_fallback: disaggregated only: while no prefill worker is ready (all down, or
        every one a request tried failed it), the decoder prefills the request itself, in its
        own steps (its other requests' tokens slow down meanwhile); false fails the request
        with UNAVAILABLE instead.
    """

    address: str = "127.0.0.1:50051"
    http_address: str | None = "127.0.0.1:8000"
    policy: str = "least_outstanding"
    max_queue: int = 1024
    default_max_tokens: int = 256
    grace_seconds: float = 5.0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    prefill_retries: int = 1
    worker_retries: int = 1
    local_prefill_fallback: bool = True
    auth: AuthConfig = field(default_factory=AuthConfig)
    tls: TLSConfig = field(default_factory=TLSConfig)

    def __post_init__(self) -> None:
        grpc_host, grpc_port = _split_address(self.address)
        if self.http_address is not None:
            http_host, http_port = _split_address(self.http_address, "http_address")
            if grpc_port == http_port != 0 and _hosts_overlap(grpc_host, http_host):
                # Else the second bind fails only after every worker was placed.
                raise ConfigError(
                    "http_address",
                    f"{self.http_address} is the gRPC address's port too ({self.address})",
                )
        check_choice("policy", self.policy, ROUTING_POLICIES)
        check_int("max_queue", self.max_queue, 0)
        check_int("default_max_tokens", self.default_max_tokens, 1)
        check_number("grace_seconds", self.grace_seconds, 0)
        check_int("max_request_bytes", self.max_request_bytes, 1024)
        check_int("prefill_retries", self.prefill_retries, 0)
        check_int("worker_retries", self.worker_retries, 0)
        check_bool("local_prefill_fallback", self.local_prefill_fallback)
        if self.max_request_bytes > MAX_REQUEST_BYTES_LIMIT:
            raise ConfigError(
                "max_request_bytes",
                f"must be <= {MAX_REQUEST_BYTES_LIMIT} (1GiB), got {self.max_request_bytes}",
            )

    @property
    def host(self) -> str:
        return _split_address(self.address)[0]

    @property
    def port(self) -> int:
        return _split_address(self.address)[1]

    @property
    def http_host_port(self) -> tuple[str, int] | None:
        if self.http_address is None:
            return None
        return _split_address(self.http_address, "http_address")


def _hosts_overlap(first: str, second: str) -> bool:
    """Whether binding one port on both hosts clashes: the same host, a wildcard, or
    ``localhost`` (any case) beside a loopback address it resolves to."""
    first, second = first.lower(), second.lower()
    if first == second or {first, second} & WILDCARD_HOSTS:
        return True
    return "localhost" in (first, second) and {first, second} <= LOOPBACK_HOSTS | {"localhost"}


def _split_address(address: object, name: str = "address") -> tuple[str, int]:
    if not isinstance(address, str):
        raise ConfigError(name, f"must be a 'host:port' string, got {address!r}")
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [::1]:50051
    # isdigit() takes '5²' (int() then raises) and isdecimal() other scripts' digits.
    if not sep or not host or not (port.isascii() and port.isdecimal()) or int(port) > 65535:
        raise ConfigError(name, f"must be 'host:port' with a port in 0-65535, got {address!r}")
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    """``host:port`` as clients dial it: an IPv6 host in brackets (``[::1]:50051``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
