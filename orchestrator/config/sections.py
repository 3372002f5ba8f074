"""The sections of the cluster configuration (`orchestrator.config.cluster`), one frozen pydantic
model each (`orchestrator.config.base.Section`).

Each section checks its own keys and names them relative to itself (``tp``); the error's path
places them under the section's own (``groups.decode.tp``). Rules across sections live in
`orchestrator.config.cluster.ClusterConfig`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationInfo, WithJsonSchema, field_validator, model_validator

from orchestrator.config.base import (
    Bytes,
    ConfigError,
    ConfigPath,
    OneOf,
    Section,
    check_number,
    mapping,
    resolve_path,
)
from workers.engine.speculative import MAX_SPECULATIVE_TOKENS
from workers.engine.speculative import METHODS as SPECULATIVE_METHODS
from workers.netaddr import WILDCARD_HOSTS

__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "FABRIC_PROVIDERS",
    "FABRIC_PROVIDER_ALIASES",
    "GROUP_ROLES",
    "LOOPBACK_HOSTS",
    "MAX_REQUEST_BYTES_LIMIT",
    "ROUTING_POLICIES",
    "AuthConfig",
    "ConfigError",
    "FabricConfig",
    "GroupConfig",
    "Limits",
    "Resources",
    "RouterConfig",
    "SpeculativeSection",
    "TLSConfig",
    "TransferConfig",
]

GROUP_ROLES: tuple[str, ...] = ("prefill", "decode", "mixed")
# libfabric providers the KV transfer is written for (the transfer engine's design, §5).
FABRIC_PROVIDERS: tuple[str, ...] = ("tcp;ofi_rxm", "shm", "verbs;ofi_rxm", "efa")
# Short names accepted for convenience, as in `workers.fabric.providers`.
FABRIC_PROVIDER_ALIASES: dict[str, str] = {"tcp": "tcp;ofi_rxm", "verbs": "verbs;ofi_rxm"}
ROUTING_POLICIES: tuple[str, ...] = ("least_outstanding", "round_robin", "random", "kv_aware")
# The loopback addresses `localhost` resolves to (either or both): binding it takes them.
LOOPBACK_HOSTS: frozenset[str] = frozenset({"127.0.0.1", "::1"})
# router.max_request_bytes: gRPC's own default receive limit, so nothing that fit before is
# refused; room for a 128k-token prompt as token ids (at most 5 bytes each) or as text.
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
# The gRPC transport limit is twice router.max_request_bytes and gRPC takes an int32.
MAX_REQUEST_BYTES_LIMIT = 2**30


class Limits(Section):
    """Engine limits of every worker (top-level ``limits``) or of one group (merged)."""

    max_model_len: int | None = Field(default=None, ge=2)
    """Prompt + output tokens per request; null means the model's own limit."""
    max_num_seqs: int = Field(default=64, ge=1)
    """Requests per engine batch."""
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    """Tokens of one engine step; a multiple of ``page_size`` so that prefill chunks end on page
    boundaries (each page then moves in whole writes)."""
    num_pages: int | None = Field(default=None, ge=1)
    """KV pages of each rank, allocated up front (or give ``kv_memory_bytes``, not both)."""
    kv_memory_bytes: Annotated[int, Bytes(minimum=1)] | None = None
    """KV pool of each rank in bytes, allocated up front (or give ``num_pages``, not both)."""
    enable_chunked_prefill: bool = True
    """Split long prompts into chunks of ``max_num_batched_tokens``."""
    enable_prefix_caching: bool | None = None
    """Reuse the KV of full pages whose tokens, from the prompt's start, match an earlier
    request's (system prompts, earlier chat turns): those tokens are not computed again, and a
    decoder that holds them is not sent them again. null (the default): on, except in groups
    that draft with MTP and prefill groups computing the MTP layer for them (not supported
    together yet); true / false: on / off (true with MTP drafting is refused)."""
    min_step_interval_ms: float = Field(default=0.0, ge=0.0, le=1000.0, allow_inf_nan=False)
    """A step that only decodes starts at least this long after the previous step started;
    steps with prompt work (a prompt chunk, a decoder admitting arrived KV) start at once, so
    prefill workers never wait on it. 0 (the default): decode steps run back to back. For
    decoders that share cores with prefill workers: a step reads every weight once however many
    requests it decodes, so fewer, fuller steps leave the prefill workers CPU, at a TPOT of
    about this interval."""

    @model_validator(mode="after")
    def _consistent(self) -> Limits:
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
        return self


# As YAML: a mapping of name to amount; as the model: sorted pairs, so it stays hashable.
_CUSTOM_RESOURCES_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": {"type": "number", "exclusiveMinimum": 0},
}


class Resources(Section):
    """What Ray reserves for each rank: one placement-group bundle."""

    cpu: float = Field(default=1.0, ge=0)
    """CPUs of each rank."""
    gpu: float = Field(default=0.0, ge=0)
    """GPUs of each rank."""
    memory: Annotated[int, Bytes(minimum=1)] | None = None
    """Bytes of memory of each rank; null reserves none."""
    custom: Annotated[tuple[tuple[str, float], ...], WithJsonSchema(_CUSTOM_RESOURCES_SCHEMA)] = (
        Field(default=(), json_schema_extra={"default": {}})
    )
    """Ray custom resources (name: amount), e.g. to pin a group to nodes that advertise
    ``prefill_node``."""

    @field_validator("custom", mode="before")
    @classmethod
    def _custom_pairs(cls, value: object) -> object:
        pairs = sorted(mapping(value).items()) if isinstance(value, Mapping) else value
        if not isinstance(pairs, tuple | list):
            return pairs  # the type check words it
        for pair in pairs:
            if not (isinstance(pair, tuple | list) and len(pair) == 2):
                raise ConfigError("", f"must map resource names to amounts, got {pair!r}")
            name, amount = pair
            if not isinstance(name, str) or not name or name in ("CPU", "GPU", "memory"):
                raise ConfigError("", f"bad resource name {name!r}")
            check_number(name, amount, 0, strict=True)
        return tuple((name, float(amount)) for name, amount in pairs)

    @model_validator(mode="after")
    def _asks_for_something(self) -> Resources:
        if not self.bundle():
            # Ray refuses a bundle of zero resources.
            raise ConfigError("", "asks for nothing; give cpu, gpu, memory or a custom resource")
        return self

    def bundle(self) -> dict[str, float]:
        """The Ray placement-group bundle of one rank (zero amounts left out, as Ray wants)."""
        amounts: dict[str, float] = {"CPU": self.cpu, "GPU": self.gpu}
        if self.memory is not None:
            amounts["memory"] = self.memory
        amounts.update(self.custom)
        return {name: amount for name, amount in amounts.items() if amount > 0}


# At most this many NICs per rank (`workers.kv.protocol.MAX_NICS`: what a request can name).
MAX_NICS = 16
# fabric.nics: a list of interface names or addresses, or "auto"; as JSON schema.
NICS_SCHEMA: dict[str, Any] = {
    "oneOf": [
        {"const": "auto"},
        {
            "type": "array",
            "items": {"type": "string", "minLength": 1},
            "minItems": 1,
            "maxItems": MAX_NICS,
            "uniqueItems": True,
        },
    ]
}
# Linux interface names: at most 15 bytes (IFNAMSIZ less its NUL), no "/" nor whitespace.
_MAX_INTERFACE_NAME = 15


def nic_entry_problem(entry: str) -> str | None:
    """What is wrong with one ``fabric.nics`` entry by its form (None: nothing). Whether it
    names an interface or an address of the host is known only there: each worker resolves
    its entries when it starts (`workers.fabric.nics.resolve_nic`)."""
    try:
        address = ipaddress.ip_address(entry)
    except ValueError:
        address = None
    if address is not None:
        if address.is_unspecified:
            return f"{entry} is every interface, not one NIC"
        if address.is_multicast:
            return f"{entry} is a multicast address"
        return None
    if entry == "auto":
        return "auto stands alone (nics: auto), not in a list"
    if len(entry.encode()) > _MAX_INTERFACE_NAME or "/" in entry or entry in (".", ".."):
        return f"{entry!r} is neither an IP address nor an interface name"
    if any(char.isspace() for char in entry):
        return f"{entry!r} is neither an IP address nor an interface name"
    return None


class FabricConfig(Section):
    """How a prefill or decode group's KV moves."""

    provider: Annotated[str, OneOf(FABRIC_PROVIDERS, FABRIC_PROVIDER_ALIASES)] = "tcp;ofi_rxm"
    """libfabric provider; an alias (``tcp``, ``verbs``) is stored as its canonical layered
    name, so that peers compare providers as plain strings."""
    node: str | None = Field(default=None, min_length=1)
    """Address (or host name) the transfer engine binds to. Null: with ``tcp;ofi_rxm`` the IP
    of the Ray node each worker lands on (what the other nodes reach), with the other providers
    the interface they pick. A loopback address is refused once workers land on several
    nodes. Give ``node`` or a list of ``nics``, not both."""
    nics: Annotated[str | tuple[str, ...], WithJsonSchema(NICS_SCHEMA)] = Field(
        default="auto", json_schema_extra={"default": "auto"}
    )
    """The NICs each worker's leader rank moves KV through: ``auto`` (the default), one, as set
    by ``node``; or a list of interface names (``eth1``) or addresses of the worker's host. With
    several, the rank opens one transfer engine (libfabric domain and endpoint) per NIC and
    registers its KV pools with each; the first is the one peers know (control messages, the
    prefill endpoint). A prefill worker sends each request's KV writes through one pair of its
    NICs and the decoder's, taken in turn, and the decoder counts them on all of its NICs
    (design §5). Entries are resolved on the host each worker lands on, when it starts: one
    that names neither an interface nor an address there fails the worker's start, naming
    it. Not with ``shm`` (it moves KV through the host's memory, no NIC), nor with ``node``."""

    @field_validator("nics", mode="before")
    @classmethod
    def _nic_list(cls, value: object) -> object:
        if value == "auto":
            return value
        if not isinstance(value, list | tuple):
            raise ConfigError(
                "", f"must be auto or a list of interface names or addresses, got {value!r}"
            )
        if not value:
            raise ConfigError("", "an empty list opens no NIC; leave it auto for one")
        if len(value) > MAX_NICS:
            raise ConfigError("", f"at most {MAX_NICS} NICs, got {len(value)}")
        for index, entry in enumerate(value):
            if not isinstance(entry, str) or not entry:
                raise ConfigError(str(index), f"must be a non-empty string, got {entry!r}")
            problem = nic_entry_problem(entry)
            if problem is not None:
                raise ConfigError(str(index), problem)
            if entry in value[:index]:
                raise ConfigError(str(index), f"{entry} is listed twice")
        return tuple(value)

    @model_validator(mode="after")
    def _nics_and_node(self) -> FabricConfig:
        entries = self.nic_entries
        if entries and self.node is not None:
            raise ConfigError("nics", "give node or a list of nics, not both")
        if self.provider == "shm" and len(entries) > 1:
            raise ConfigError(
                "nics", "shm moves KV through the host's memory, not a NIC: give one or auto"
            )
        return self

    @property
    def nic_entries(self) -> tuple[str, ...]:
        """The listed NICs; empty for ``auto``."""
        return self.nics if isinstance(self.nics, tuple) else ()


class SpeculativeSection(Section):
    """Speculative decoding on a decode or mixed group (`workers.engine.speculative`): drafts
    proposed cheaply and verified by the model in one step; outputs are unchanged (greedy:
    token-identical; sampling: the same distribution)."""

    method: Annotated[str, OneOf(SPECULATIVE_METHODS)] = "ngram"
    """The proposer: ``ngram`` (prompt lookup: what followed the latest earlier occurrence of
    the sequence's last n tokens), ``mtp`` (a DeepSeek-V3 checkpoint's MTP module, chained for
    more than one draft; on a decode group the prefill group computes the module's KV of the
    prompt and ships the hidden state its first draft starts from) or ``draft_model``
    (``model``, a smaller checkpoint with the same tokenizer)."""
    num_speculative_tokens: int = Field(default=3, ge=1, le=MAX_SPECULATIVE_TOKENS)
    """Drafts per step; a step emits between 1 and this many + 1 tokens."""
    prompt_lookup_min: int = Field(default=1, ge=1)
    """Shortest n-gram ngram looks up."""
    prompt_lookup_max: int = Field(default=3, ge=1)
    """Longest n-gram ngram looks up (tried first)."""
    model: ConfigPath | None = None
    """The draft checkpoint's directory (``draft_model`` only), relative to the YAML file."""

    @field_validator("model", mode="before")
    @classmethod
    def _model_path(cls, value: object, info: ValidationInfo) -> Path | None:
        return None if value is None else resolve_path(value, info)

    @model_validator(mode="after")
    def _lookup_range(self) -> SpeculativeSection:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError("prompt_lookup_min", "must not exceed prompt_lookup_max")
        return self


class GroupConfig(Section):
    """``replicas`` identical workers of one role, each a TP group of ``tp`` ranks."""

    role: Annotated[str, OneOf(GROUP_ROLES)]
    """prefill, decode or mixed (in the YAML, the group's key under ``groups``)."""
    replicas: int = Field(default=1, ge=1)
    """Workers of this group."""
    tp: int = Field(default=1, ge=1)
    """Ranks per replica (tensor parallel size)."""
    resources_per_rank: Resources = Field(default_factory=Resources)
    """What Ray reserves for each rank."""
    fabric: FabricConfig | None = None
    """How KV moves: required for prefill and decode (the loader fills in the default), absent
    for mixed."""
    limits: Limits = Field(default_factory=Limits)
    """Overrides of the top-level limits for this group."""
    nice: int = Field(default=0, ge=0, le=19)
    """CPU priority of the group's worker processes (Linux nice, 0 = normal, 19 = lowest). Where
    roles share a host's CPUs (no accelerator, or the local 1:N setups), a prefill group at a
    higher nice keeps long prompt chunks from delaying the latency-critical decode steps; on
    separate machines it does nothing. Only lowering is allowed: raising needs privileges."""
    threads: int = Field(default=1, ge=1)
    """Intra-op (torch / OpenMP) threads of each rank's process."""
    speculative: SpeculativeSection | None = None
    """Speculative decoding (decode and mixed groups); null: off."""

    @model_validator(mode="after")
    def _fabric_by_role(self) -> GroupConfig:
        if self.role == "prefill" and self.speculative is not None:
            raise ConfigError("speculative", "a prefill group never samples; set it on decode")
        if self.role == "mixed" and self.fabric is not None:
            raise ConfigError("fabric", "mixed workers move no KV between workers; remove it")
        if self.role != "mixed" and self.fabric is None:
            raise ConfigError("fabric", f"required for a {self.role} group")
        return self

    @property
    def num_ranks(self) -> int:
        return self.replicas * self.tp


class TransferConfig(Section):
    """KV transfers between prefill and decode workers."""

    deadline_seconds: float = Field(default=30.0, gt=0)
    """A decoder fails a request whose KV has not fully arrived by then."""
    drain_interval_seconds: float = Field(default=5.0, ge=0)
    """How often a decoder re-sends AbortPrefill for a failed transfer whose pages are
    quarantined (and checks whether its prefill process is gone). Pages are freed only once no
    write can land in them (acknowledged writes landed, or the prefill process gone), never
    after a time: a late write can never land in a page given to a newer request
    (`workers.kv.quarantine`)."""
    liveness_interval_seconds: float = Field(default=1.0, ge=0)
    """How often a decoder checks the prefill worker of a transfer that had no write land since
    the last check (the fabric's failure record; on tcp a connect to its listener). A gone one
    (killed, crashed) fails its transfers at once, so the router retries them on another
    prefill worker instead of at the deadline. 0: off."""
    coalesce_pages: bool = True
    """Merge writes of adjacent pages (both sides must agree: it is sent along)."""
    checksum: bool = False
    """Decoders verify every transfer's KV against checksums the prefill worker sends in the
    context write (`workers.kv.checksum`); a mismatch fails the request. Off by default: it
    costs a CRC-32 pass over the KV on both sides. Decoders ask for it per request."""


class AuthConfig(Section):
    """A bearer token every client must send: ``Authorization: Bearer <token>`` on HTTP (else
    401), ``authorization: Bearer <token>`` metadata on gRPC (else UNAUTHENTICATED). Health
    checks are exempt (``/health``, ``grpc.health.v1.Health``). Checked by
    `orchestrator.api.security` and `orchestrator.api.http`."""

    # Out of repr: configs get logged, secrets must not be.
    token: str | None = Field(default=None, min_length=1, repr=False)
    """The token; null disables auth. The YAML may name a file holding it instead
    (``token_file``, read when the config loads: a mounted Kubernetes Secret, say)."""

    @model_validator(mode="before")
    @classmethod
    def _token_file(cls, data: Any, info: ValidationInfo) -> Any:
        """``token_file`` replaced by the token the file holds (surrounding whitespace, a
        trailing newline say, is not part of it)."""
        if isinstance(data, cls):
            return data
        data = mapping(data)
        if data.get("token_file") is None:
            data.pop("token_file", None)
            return data
        try:
            path = resolve_path(data.pop("token_file"), info)
        except ConfigError as exc:
            raise exc.under("token_file") from None
        if data.get("token") is not None:
            raise ConfigError("token_file", "give token or token_file, not both")
        try:
            token = path.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise ConfigError("token_file", f"cannot read {path}: {reason}") from None
        if not token:
            raise ConfigError("token_file", f"{path} is empty")
        return {**data, "token": token}


class TLSConfig(Section):
    """TLS of both router fronts (gRPC and HTTP), PEM files. cert + key turn TLS on; ca in
    addition requires client certificates signed by it (mTLS). The router reads and checks the
    files when it starts (`orchestrator.api.security.load_server_tls`), before placing workers.
    Relative paths resolve against the YAML file's directory."""

    cert: ConfigPath | None = None
    """The server's certificate chain."""
    key: ConfigPath | None = None
    """The server's private key."""
    ca: ConfigPath | None = None
    """CA that client certificates must be signed by (mTLS); null: no client certificates."""

    @field_validator("cert", "key", "ca", mode="before")
    @classmethod
    def _resolve(cls, value: object, info: ValidationInfo) -> object:
        return None if value is None else resolve_path(value, info)

    @model_validator(mode="after")
    def _pairs(self) -> TLSConfig:
        if (self.cert is None) != (self.key is None):
            raise ConfigError("cert" if self.cert is None else "key", "cert and key go together")
        if self.ca is not None and self.cert is None:
            raise ConfigError("ca", "client verification needs the server's own cert and key")
        return self

    @property
    def enabled(self) -> bool:
        return self.cert is not None


class RouterConfig(Section):
    """The front doors: gRPC, and the OpenAI-compatible HTTP API (`orchestrator.api.http`)."""

    address: str = "127.0.0.1:50051"
    """gRPC ``host:port`` to listen on (port 0: any free port)."""
    http_address: str | None = "127.0.0.1:8000"
    """HTTP ``host:port`` of ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` and
    ``/health``; null serves no HTTP."""
    policy: Annotated[str, OneOf(ROUTING_POLICIES)] = "least_outstanding"
    """How the router picks a worker. ``kv_aware``: the decode (or mixed) worker whose prefix
    cache is thought to hold most of the prompt, weighed against its load, and the prefill
    worker with the least uncomputed work queued, counting what it holds cached (the router's
    estimate from what it sent each worker); pair it with ``limits.enable_prefix_caching``."""
    kv_cache_weight: float = Field(default=1.0, ge=0)
    """``kv_aware``: weight of the share of a prompt a worker holds cached in its score."""
    kv_load_weight: float = Field(default=1.0, ge=0)
    """``kv_aware``: weight of a worker's load (requests in flight / ``limits.max_num_seqs``)
    in its score; with both weights 1 a worker keeps a conversation whose history it holds until
    it carries a full worker's load more than another."""
    max_queue: int = Field(default=1024, ge=0)
    """Requests held while no decode worker has room; more get RESOURCE_EXHAUSTED."""
    default_max_tokens: int = Field(default=256, ge=1)
    """For requests that leave ``max_tokens`` unset."""
    grace_seconds: float = Field(default=5.0, ge=0)
    """How long a stopping router lets streams finish."""
    max_request_bytes: Annotated[int, Bytes(minimum=1024, maximum=MAX_REQUEST_BYTES_LIMIT)] = (
        DEFAULT_MAX_REQUEST_BYTES
    )
    """Largest request accepted, as serialized protobuf (gRPC) or as the JSON body (HTTP); larger
    ones get INVALID_ARGUMENT / HTTP 400 before they are parsed. The gRPC server's transport
    limit is twice this: beyond it gRPC itself answers RESOURCE_EXHAUSTED without reading the
    message."""
    prefill_retries: int = Field(default=1, ge=0)
    """Disaggregated only: how many other prefill workers a request tries when its KV transfer
    failed before any token was streamed (prefill dead, stalled past the transfer deadline, or
    refusing it); 0 fails the request at once."""
    worker_retries: int = Field(default=1, ge=0)
    """How many other decode (or mixed) workers a request tries when its worker was lost before
    any token was streamed (it died, failed its health check, or refused the request as
    unavailable: draining, closing, KV fabric unusable); 0 fails it at once."""
    local_prefill_fallback: bool = True
    """Disaggregated only: while no prefill worker is ready (all down, or every one a request
    tried failed it), the decoder prefills the request itself, in its own steps (its other
    requests' tokens slow down meanwhile); false fails the request with UNAVAILABLE instead."""
    auth: AuthConfig = Field(default_factory=AuthConfig)
    """Bearer-token auth of both fronts."""
    tls: TLSConfig = Field(default_factory=TLSConfig)
    """TLS of both fronts."""

    @field_validator("address", "http_address", mode="before")
    @classmethod
    def _host_port(cls, value: object, info: ValidationInfo) -> object:
        if value is None and info.field_name == "http_address":
            return None
        _split_address(value)
        return value

    @model_validator(mode="after")
    def _distinct_ports(self) -> RouterConfig:
        grpc_host, grpc_port = _split_address(self.address)
        if self.http_address is not None:
            http_host, http_port = _split_address(self.http_address)
            if grpc_port == http_port != 0 and _hosts_overlap(grpc_host, http_host):
                # Else the second bind fails only after every worker was placed.
                raise ConfigError(
                    "http_address",
                    f"{self.http_address} is the gRPC address's port too ({self.address})",
                )
        return self

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
        return _split_address(self.http_address)


def _hosts_overlap(first: str, second: str) -> bool:
    """Whether binding one port on both hosts clashes: the same host, a wildcard, or
    ``localhost`` (any case) beside a loopback address it resolves to."""
    first, second = first.lower(), second.lower()
    if first == second or {first, second} & WILDCARD_HOSTS:
        return True
    return "localhost" in (first, second) and {first, second} <= LOOPBACK_HOSTS | {"localhost"}


def _split_address(address: object) -> tuple[str, int]:
    if not isinstance(address, str):
        raise ConfigError("", f"must be a 'host:port' string, got {address!r}")
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [::1]:50051
    # isdigit() takes '5²' (int() then raises) and isdecimal() other scripts' digits.
    if not sep or not host or not (port.isascii() and port.isdecimal()) or int(port) > 65535:
        raise ConfigError("", f"must be 'host:port' with a port in 0-65535, got {address!r}")
    return host, int(port)
