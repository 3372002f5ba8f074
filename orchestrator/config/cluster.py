"""The cluster configuration: one YAML file, parsed into frozen pydantic models validated once.

Layout (every key optional unless marked; `configs/*.yaml` are complete examples)::

    model: DIR                      # required; HF checkpoint directory
    dtype: auto | float32 | bfloat16 | float16
    device: cpu | cuda | cuda:N | auto  # where every worker's engine runs (see ClusterConfig)
    page_size: 16                   # tokens per KV page, a power of two
    worker_host: null               # where workers' gRPC and /metrics listen (see ClusterConfig)
    limits: {max_model_len, max_num_seqs, max_num_batched_tokens,
             num_pages | kv_memory_bytes, enable_chunked_prefill, enable_prefix_caching,
             min_step_interval_ms}
    groups:                         # required; prefill + decode, or mixed alone
      prefill | decode | mixed:
        replicas: 1
        tp: 1                       # ranks per replica (tensor parallel size)
        resources_per_rank: {cpu, gpu, memory, custom: {NAME: AMOUNT}}
        fabric: {provider, node}    # prefill and decode only
        limits: {...}               # overrides of GROUP_LIMIT_KEYS for this group
        nice: 0                     # CPU priority of its processes (0-19, see GroupConfig)
        threads: 1                  # torch intra-op threads per rank
    transfer: {deadline_seconds, drain_interval_seconds, liveness_interval_seconds,
               coalesce_pages, checksum}
    router: {address, http_address, policy, max_queue, default_max_tokens, grace_seconds,
             max_request_bytes, prefill_retries, worker_retries, local_prefill_fallback,
             auth: {token | token_file}, tls: {cert, key, ca}}

``router.auth.token_file`` names a file holding the token (a mounted Kubernetes Secret, say),
read when the config loads, so the token itself need not sit in the YAML. Relative paths
(``model``, TLS files, the token file) are resolved against the YAML file's directory, so a
config means the same thing from any working directory. Byte sizes (``kv_memory_bytes``,
``memory``, ``router.max_request_bytes``) take an integer or a string with a unit (``512MiB``,
``4GiB``, ``1GB``).

Every error is a `ConfigError` whose message starts with the dotted path of the offending key
(``groups.decode.tp: must be >= 1, got 0``). Rules that need the model (TP against KV heads,
``max_model_len`` against the model's own limit) read ``DIR/config.json`` when the directory
exists on this host and are skipped, with a warning, when it does not.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import Field, ValidationInfo, field_validator, model_validator

from orchestrator.config.base import (
    ConfigError,
    ConfigPath,
    OneOf,
    Section,
    mapping,
    reject_unknown,
    resolve_path,
)
from orchestrator.config.sections import (
    FABRIC_PROVIDER_ALIASES,
    FABRIC_PROVIDERS,
    GROUP_ROLES,
    ROUTING_POLICIES,
    AuthConfig,
    FabricConfig,
    GroupConfig,
    Limits,
    Resources,
    RouterConfig,
    SpeculativeSection,
    TLSConfig,
    TransferConfig,
)
from orchestrator.config.yaml_file import read_yaml
from workers.engine.config import DTYPES, EngineConfig
from workers.engine.device import DeviceError, check_device_name
from workers.engine.errors import UnsupportedCheckpointError
from workers.engine.model_config import ModelConfig
from workers.engine.speculative import SpeculativeConfig

__all__ = [
    "FABRIC_PROVIDERS",
    "FABRIC_PROVIDER_ALIASES",
    "GROUP_LIMIT_KEYS",
    "GROUP_ROLES",
    "MAX_GROUP_RATIO",
    "NO_ADDRESS_WORDS",
    "ROUTING_POLICIES",
    "AuthConfig",
    "ClusterConfig",
    "ConfigError",
    "FabricConfig",
    "GroupConfig",
    "Limits",
    "Resources",
    "RouterConfig",
    "TLSConfig",
    "TransferConfig",
]

logger = logging.getLogger(__name__)
# Model directories already warned about as missing on this host (`ClusterConfig._check_model`).
_MISSING_MODELS_WARNED: set[Path] = set()

_S = TypeVar("_S", bound=Section)

# Limits a group may override: the engine's batch shape and KV pool. max_model_len is not among
# them: it is a per-request contract that every worker on a request's path must honour.
GROUP_LIMIT_KEYS: tuple[str, ...] = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "num_pages",
    "kv_memory_bytes",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "min_step_interval_ms",
)
# One prefill replica keeps about three decode replicas busy in the reference deployment; a
# ratio beyond this, either way, leaves one side idle and is almost surely a typo.
MAX_GROUP_RATIO = 16
# Command-line words for "no address" (`--http-address none`).
NO_ADDRESS_WORDS: tuple[str, ...] = ("none", "null", "off")
# The spellings `workers.engine.device.check_device_name` accepts, for JSON schemas.
DEVICE_PATTERN = r"^(cpu|auto|cuda(:[0-9]+)?)$"
# A JSON schema cannot say "a power of two": these are the page sizes it offers.
PAGE_SIZES = [2**k for k in range(13)]


# --- the whole cluster ----------------------------------------------------------------------


class ClusterConfig(Section):
    """One cluster: the model, its worker groups, KV transfers and the router.

    ``groups`` holds prefill then decode (disaggregated), or mixed alone (colocated baseline);
    the YAML gives them as a mapping of role to group (`_from_document`).
    ``device``: where the workers' engines run (`workers.engine.device`). On ``cuda`` every
    group reserves a GPU per rank (``resources_per_rank.gpu``: Ray then sets each worker's
    ``CUDA_VISIBLE_DEVICES``; a TP worker's ranks share one bundle, `worker_bundles`, so its
    leader sees a GPU for each), and KV transfers need a provider that registers GPU memory
    (FI_HMEM: ``verbs``, ``efa``; ``shm`` on one node when libfabric was built with CUDA,
    which the workers find out at start), which ``tcp`` cannot. On ``auto`` the latter rule
    holds for every group that reserves GPUs: its ranks see one, and auto picks cuda there.
    ``worker_host``: the address every worker's token service (gRPC, which the router dials) and
    ``/metrics`` bind. Null (the default): the IP of the Ray node each worker lands on, which
    is loopback under the embedded single-node Ray and the node's address in a cluster of
    several hosts. ``0.0.0.0`` (or ``::``, the Helm chart) binds every interface and
    advertises the node's IP (`workers.service.actor.advertised_address`). A loopback address
    is refused once workers land on several nodes.
    Cross-field rules run as a model validator, so that `replace` (and `with_overrides`)
    revalidate the result.
    """

    model: ConfigPath
    """The model's checkpoint directory (a Hugging Face checkpoint)."""
    groups: tuple[GroupConfig, ...]
    """prefill and decode (disaggregated), or mixed alone (colocated)."""
    dtype: Annotated[str, OneOf(DTYPES)] = "auto"
    """Model dtype; auto takes the checkpoint's own."""
    device: str = Field(default="cpu", json_schema_extra={"pattern": DEVICE_PATTERN})
    """Where every worker's engine runs: cpu, cuda, cuda:N or auto."""
    page_size: int = Field(default=16, ge=1, json_schema_extra={"enum": PAGE_SIZES})
    """Tokens per KV page, a power of two."""
    worker_host: str | None = None
    """Where workers' gRPC and /metrics listen (a host, no port); null: each worker's Ray node
    IP."""
    limits: Limits = Field(default_factory=Limits)
    """Engine limits of every worker; a group may override some (`GROUP_LIMIT_KEYS`)."""
    transfer: TransferConfig = Field(default_factory=TransferConfig)
    """KV transfers between prefill and decode workers."""
    router: RouterConfig = Field(default_factory=RouterConfig)
    """The router's front doors."""

    # --- the YAML document -> the model -----------------------------------------------------

    @model_validator(mode="before")
    @classmethod
    def _from_document(cls, data: Any, info: ValidationInfo) -> Any:
        """Groups given as the YAML's mapping of role to group become `GroupConfig`s, each with
        the top-level limits under its own overrides. The top-level limits are checked before
        any group's, so a group that fails on its limits does so because of its own override:
        the path names where to fix it."""
        if isinstance(data, cls):
            return data
        data = mapping(data)
        reject_unknown(data, cls.model_fields)
        if data.get("model") is None:
            raise ConfigError("model", "required: the model's checkpoint directory")
        if data.get("groups") is None:
            raise ConfigError("groups", "required: prefill and decode, or mixed")
        if isinstance(data["groups"], tuple):
            return data  # already the model's tuple of groups
        limits = data.get("limits")
        top_limits = mapping(limits, "limits") if not isinstance(limits, Limits) else dict(limits)
        groups = mapping(data["groups"], "groups")
        reject_unknown(groups, GROUP_ROLES, "groups")
        return {
            **data,
            "limits": _validated(Limits, top_limits, "limits", info),
            "groups": tuple(
                _group(role, groups[role], top_limits, info)
                for role in GROUP_ROLES
                if role in groups
            ),
        }

    # --- one key at a time ----------------------------------------------------------------

    @field_validator("model", mode="before")
    @classmethod
    def _model_path(cls, value: object, info: ValidationInfo) -> Path:
        return resolve_path(value, info)

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, value: Any) -> Any:
        try:
            check_device_name(value)
        except DeviceError as exc:
            raise ConfigError("", str(exc)) from None
        return value

    @field_validator("page_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ConfigError("", f"must be a power of two, got {value}")
        return value

    @field_validator("worker_host", mode="before")
    @classmethod
    def _host(cls, value: object) -> object:
        """A host to bind (a name or an IP address, no port): ``127.0.0.1``, ``0.0.0.0``, ``::``."""
        if value is None:
            return value
        if (
            not isinstance(value, str)
            or not value
            or any(ch.isspace() or ch in "[]/" for ch in value)
            or (value.count(":") == 1)  # IPv6 has two or more; one means host:port
        ):
            raise ConfigError(
                "", f"must be a host name or IP address without a port, got {value!r}"
            )
        return value

    # --- rules across sections ------------------------------------------------------------

    @model_validator(mode="after")
    def _cross_rules(self) -> ClusterConfig:
        self._check_groups()
        self._check_limits(self.limits, "limits")
        for group in self.groups:
            self._check_limits(group.limits, f"groups.{group.role}.limits")
            try:
                self.engine_config(group.role)
            except ValueError as exc:  # the engine's own rules, should ours miss one
                raise ConfigError(f"groups.{group.role}", f"the engine rejects it: {exc}") from None
        self._check_model()
        return self

    def _check_groups(self) -> None:
        roles = [group.role for group in self.groups]
        if sorted(roles) not in (["decode", "prefill"], ["mixed"]):
            raise ConfigError(
                "groups", f"give prefill and decode, or mixed alone; got {roles or 'none'}"
            )
        if self.is_disaggregated:
            prefill, decode = self.group("prefill"), self.group("decode")
            replicas = (prefill.replicas, decode.replicas)
            if max(replicas) > MAX_GROUP_RATIO * min(replicas):
                raise ConfigError(
                    "groups",
                    f"prefill:decode replicas {prefill.replicas}:{decode.replicas} is beyond "
                    f"1:{MAX_GROUP_RATIO} either way; one side would sit idle",
                )
        if self.device != "cpu":
            self._check_cuda_groups()

    def _check_cuda_groups(self) -> None:
        for group in self.groups:
            path = f"groups.{group.role}"
            gpu = group.resources_per_rank.gpu
            if self.device.startswith("cuda") and gpu < 1:
                raise ConfigError(
                    f"{path}.resources_per_rank.gpu",
                    f"device {self.device} needs a GPU per rank, got {gpu}",
                )
            # auto resolves to cuda on a rank that reserves a GPU (Ray makes it visible): its KV
            # sits in GPU memory as on cuda, and tcp would fail only when the worker starts.
            if gpu > 0 and group.fabric is not None and group.fabric.provider == "tcp;ofi_rxm":
                raise ConfigError(
                    f"{path}.fabric.provider",
                    f"{group.fabric.provider} cannot register GPU memory for KV transfers "
                    f"(device {self.device}, {gpu} GPU per rank); use verbs or efa (FI_HMEM), "
                    "or shm on one node",
                )

    def _check_limits(self, limits: Limits, path: str) -> None:
        # The top-level limits are checked before any group's, so a group that fails here does
        # so because of its own override: the path names where to fix it.
        if limits.max_num_batched_tokens % self.page_size:
            raise ConfigError(
                f"{path}.max_num_batched_tokens",
                f"must be a multiple of page_size ({self.page_size}) so that prefill chunks "
                f"are page-aligned, got {limits.max_num_batched_tokens}",
            )
        if self.limits.max_model_len is not None:
            self._check_pages_fit(limits, path, self.limits.max_model_len, "")

    def _check_pages_fit(self, limits: Limits, path: str, max_model_len: int, why: str) -> None:
        if limits.num_pages is not None and limits.num_pages * self.page_size < max_model_len:
            raise ConfigError(
                f"{path}.num_pages",
                f"{limits.num_pages} pages of {self.page_size} tokens hold "
                f"{limits.num_pages * self.page_size} tokens, fewer than one request of "
                f"max_model_len {max_model_len}{why}",
            )

    @staticmethod
    def _check_step_budget(limits: Limits, path: str, max_model_len: int, why: str) -> None:
        # The engine refuses the same at start (`EngineConfig.check_max_model_len`): here the
        # user learns it from the config, not from a worker that fails to come up.
        if not limits.enable_chunked_prefill and limits.max_num_batched_tokens < max_model_len:
            raise ConfigError(
                f"{path}.max_num_batched_tokens",
                f"{limits.max_num_batched_tokens} without chunked prefill: it must be >= "
                f"max_model_len {max_model_len}{why}, or long prompts could never run",
            )

    def _check_model(self) -> None:
        if not self.model.exists():
            if self.model in _MISSING_MODELS_WARNED:
                return
            # Once a path: a planner checks several configs of the same model.
            _MISSING_MODELS_WARNED.add(self.model)
            logger.warning(
                "model directory %s does not exist on this host; rules that need its "
                "config.json (TP against KV heads, max_model_len) are left to the workers",
                self.model,
            )
            return
        try:
            model = ModelConfig.from_dir(self.model)
        except (UnsupportedCheckpointError, OSError, ValueError) as exc:
            raise ConfigError("model", f"cannot read the checkpoint's config.json: {exc}") from None
        for group in self.groups:
            _check_tp(group, model)
            self._check_kv_budget(group, model)
            spec = group.speculative
            if spec is not None and spec.method == "mtp" and not model.num_mtp_layers:
                raise ConfigError(
                    f"groups.{group.role}.speculative.method",
                    "mtp needs a checkpoint with MTP modules (num_nextn_predict_layers)",
                )
        if self.limits.max_model_len is None:
            why = " (the model's own limit; set limits.max_model_len to lower it)"
            for limits, path in self._all_limits():
                self._check_pages_fit(limits, path, model.max_len, why)
                self._check_step_budget(limits, path, model.max_len, why)
        elif self.limits.max_model_len > model.max_len:
            limit = (
                f"max_position_embeddings ({model.max_position_embeddings})"
                if model.max_len == model.max_position_embeddings
                else f"sliding window ({model.max_len} tokens; not implemented past it)"
            )
            raise ConfigError(
                "limits.max_model_len",
                f"{self.limits.max_model_len} exceeds the model's {limit}",
            )

    def _check_kv_budget(self, group: GroupConfig, model: ModelConfig) -> None:
        """A pool given in bytes must hold one request of max_model_len, as one given in pages
        must (`_check_pages_fit`): the same rule, once the bytes are pages."""
        limits = group.limits
        element = DTYPE_BYTES.get(model.torch_dtype if self.dtype == "auto" else self.dtype)
        if limits.kv_memory_bytes is None or element is None:
            return
        # A rank's pool holds its share of the KV heads (one head when they are replicated).
        heads = max(1, model.num_kv_heads // group.tp)
        page_bytes = model.kv_page_bytes(self.page_size, element, heads)
        num_pages = limits.kv_memory_bytes // page_bytes
        max_model_len = self.limits.max_model_len or model.max_len
        if num_pages * self.page_size < max_model_len:
            raise ConfigError(
                f"groups.{group.role}.limits.kv_memory_bytes",
                f"{limits.kv_memory_bytes} bytes hold {num_pages} pages of {page_bytes} bytes "
                f"({num_pages * self.page_size} tokens) per rank, fewer than one request of "
                f"max_model_len {max_model_len}",
            )

    def _all_limits(self) -> Iterator[tuple[Limits, str]]:
        yield self.limits, "limits"
        for group in self.groups:
            yield group.limits, f"groups.{group.role}.limits"

    # --- queries --------------------------------------------------------------------------

    @property
    def is_disaggregated(self) -> bool:
        return any(group.role == "prefill" for group in self.groups)

    def group(self, role: str) -> GroupConfig:
        for group in self.groups:
            if group.role == role:
                return group
        raise KeyError(f"no {role!r} group; groups: {[g.role for g in self.groups]}")

    def engine_config(self, role: str) -> EngineConfig:
        """The `EngineConfig` each worker of the ``role`` group runs with."""
        group = self.group(role)
        limits = group.limits
        spec = group.speculative
        # Decoders that draft with MTP need the module's KV of the prompt from prefill.
        mtp_kv = role == "prefill" and self._decoders_draft_with_mtp
        caching = limits.enable_prefix_caching
        if caching is None:  # on wherever it is supported
            caching = not mtp_kv and (spec is None or spec.method != "mtp")
        return EngineConfig(
            role=role,  # type: ignore[arg-type]  # checked against GROUP_ROLES
            page_size=self.page_size,
            num_pages=limits.num_pages,
            kv_memory_bytes=limits.kv_memory_bytes,
            max_num_seqs=limits.max_num_seqs,
            max_num_batched_tokens=limits.max_num_batched_tokens,
            enable_chunked_prefill=limits.enable_chunked_prefill,
            enable_prefix_caching=caching,
            max_model_len=self.limits.max_model_len,
            dtype=self.dtype,
            device=self.device,
            speculative=_speculative(spec) if spec is not None else None,
            mtp_kv=mtp_kv,
            min_step_interval_s=limits.min_step_interval_ms / 1000,
        )

    @property
    def _decoders_draft_with_mtp(self) -> bool:
        spec = next((g.speculative for g in self.groups if g.role == "decode"), None)
        return spec is not None and spec.method == "mtp"

    def with_overrides(
        self,
        *,
        model: str | Path | None = None,
        address: str | None = None,
        http_address: str | None = None,
    ) -> ClusterConfig:
        """A new, revalidated config with command-line overrides (``--model``, ``--address``,
        ``--http-address``); None leaves a value as it is, and so does this config. A relative
        ``model`` is resolved against the working directory, as a command-line user expects.
        ``http_address`` ``none`` / ``null`` / ``off`` (any case) serves no HTTP: YAML's null,
        which a command line cannot write."""
        result = self
        if model is not None:
            result = result.replace(model=Path(model).expanduser().resolve())
        if address is not None:
            result = result.replace(router=_router_with(result.router, address=address))
        if http_address is not None:
            off = http_address.strip().lower() in NO_ADDRESS_WORDS
            router = _router_with(result.router, http_address=None if off else http_address)
            result = result.replace(router=router)
        return result

    # --- loading --------------------------------------------------------------------------

    @classmethod
    def from_yaml(cls, path: str | Path) -> ClusterConfig:
        path = Path(path)
        raw = read_yaml(path)
        try:
            return cls.from_dict(raw, base_dir=path.parent)
        except ConfigError as exc:
            raise ConfigError(exc.path, exc.message, path) from None

    @classmethod
    def from_dict(cls, raw: object, *, base_dir: str | Path | None = None) -> ClusterConfig:
        """Parse a loaded YAML document. Relative paths resolve against ``base_dir`` (default:
        the working directory)."""
        return cls.model_validate(raw, context={"base_dir": base_dir})


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _check_tp(group: GroupConfig, model: ModelConfig) -> None:
    kv_heads, heads = model.num_kv_heads, model.num_heads
    # Same placement rule as `workers.kv.sharding.GroupSharding`: shard the KV heads evenly, or
    # replicate each head on tp / kv_heads ranks.
    if kv_heads % group.tp and group.tp % kv_heads:
        raise ConfigError(
            f"groups.{group.role}.tp",
            f"{group.tp} must divide the model's {kv_heads} KV heads or be a multiple of them",
        )
    if heads % group.tp:
        raise ConfigError(
            f"groups.{group.role}.tp",
            f"{group.tp} must divide the model's {heads} attention heads",
        )


def _router_with(router: RouterConfig, **changes: Any) -> RouterConfig:
    try:
        return router.replace(**changes)
    except ConfigError as exc:
        raise exc.under("router") from None


def _validated(cls: type[_S], raw: object, path: str, info: ValidationInfo) -> _S:
    """``raw`` as the section ``cls``, its errors placed under ``path``."""
    try:
        return cls.model_validate(raw, context=info.context)
    except ConfigError as exc:
        raise exc.under(path) from None


def _group(role: str, raw: object, top_limits: dict[str, Any], info: ValidationInfo) -> GroupConfig:
    path = f"groups.{role}"
    data = mapping(raw, path)
    reject_unknown(data, [name for name in GroupConfig.model_fields if name != "role"], path)
    override = mapping(data.get("limits"), f"{path}.limits")
    reject_unknown(override, GROUP_LIMIT_KEYS, f"{path}.limits")
    limits = dict(top_limits)
    if "num_pages" in override or "kv_memory_bytes" in override:
        # Either key sizes the KV pool: a group giving one replaces the top-level choice.
        limits.pop("num_pages", None)
        limits.pop("kv_memory_bytes", None)
    limits.update(override)
    data = {**data, "role": role, "limits": limits}
    if role != "mixed" or "fabric" in data:  # GroupConfig rejects a mixed group's fabric
        data["fabric"] = {} if data.get("fabric") is None else data["fabric"]
    return _validated(GroupConfig, data, path, info)


def _speculative(section: SpeculativeSection) -> SpeculativeConfig:
    values = section.model_dump()
    values["model"] = str(section.model) if section.model is not None else None
    return SpeculativeConfig(**values)
