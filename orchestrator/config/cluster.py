"""The cluster configuration: one YAML file, parsed into frozen dataclasses validated once.

Layout (every key optional unless marked; `configs/*.yaml` are complete examples)::

    model: DIR                      # required; HF checkpoint directory
    dtype: auto | float32 | bfloat16 | float16
    device: cpu | cuda | cuda:N | auto  # where every worker's engine runs (see ClusterConfig)
    page_size: 16                   # tokens per KV page, a power of two
    worker_host: 127.0.0.1          # where workers' gRPC and /metrics listen (see ClusterConfig)
    limits: {max_model_len, max_num_seqs, max_num_batched_tokens,
             num_pages | kv_memory_bytes, enable_chunked_prefill}
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

import contextlib
import difflib
import logging
import re
from collections.abc import Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

import yaml

from orchestrator.config_sections import (
    FABRIC_PROVIDER_ALIASES,
    FABRIC_PROVIDERS,
    GROUP_ROLES,
    ROUTING_POLICIES,
    AuthConfig,
    ConfigError,
    FabricConfig,
    GroupConfig,
    Limits,
    Resources,
    RouterConfig,
    TLSConfig,
    TransferConfig,
    check_choice,
    check_host,
    check_int,
    join_path,
)
from workers.engine.config import DTYPES, EngineConfig
from workers.engine.device import DeviceError, check_device_name
from workers.engine.errors import UnsupportedCheckpointError
from workers.engine.model_config import ModelConfig

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

# Limits a group may override: the engine's batch shape and KV pool. max_model_len is not among
# them: it is a per-request contract that every worker on a request's path must honour.
GROUP_LIMIT_KEYS: tuple[str, ...] = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "num_pages",
    "kv_memory_bytes",
    "enable_chunked_prefill",
)
# One prefill replica keeps about three decode replicas busy in the reference deployment; a
# ratio beyond this, either way, leaves one side idle and is almost surely a typo.
MAX_GROUP_RATIO = 16
# Command-line words for "no address" (`--http-address none`).
NO_ADDRESS_WORDS: tuple[str, ...] = ("none", "null", "off")

_T = TypeVar("_T")


# --- the whole cluster ----------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterConfig:
    """One cluster: the model, its worker groups, KV transfers and the router.

    ``groups`` holds prefill then decode (disaggregated), or mixed alone (colocated baseline).
    ``device``: where the workers' engines run (`workers.engine.device`). On ``cuda`` every
    group reserves a GPU per rank (``resources_per_rank.gpu``: Ray then sets each worker's
    ``CUDA_VISIBLE_DEVICES``; a TP worker's ranks share one bundle, `worker_bundles`, so its
    leader sees a GPU for each), and KV transfers need a provider that registers GPU memory
    (FI_HMEM: ``verbs``, ``efa``; ``shm`` on one node when libfabric was built with CUDA,
    which the workers find out at start), which ``tcp`` cannot. On ``auto`` the latter rule
    holds for every group that reserves GPUs: its ranks see one, and auto picks cuda there.
    ``worker_host``: the address every worker's token service (gRPC, which the router dials) and
    ``/metrics`` bind. The default, loopback, suits one machine; a cluster over several hosts
    (the Helm chart) gives ``0.0.0.0`` (or ``::``), and each worker then advertises its Ray
    node's IP in the registry (`orchestrator.worker_actor.advertised_address`).
    Cross-field rules run here, so that `dataclasses.replace` (and `with_overrides`)
    revalidate the result.
    """

    model: Path
    groups: tuple[GroupConfig, ...]
    dtype: str = "auto"
    device: str = "cpu"
    page_size: int = 16
    worker_host: str = "127.0.0.1"
    limits: Limits = field(default_factory=Limits)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    router: RouterConfig = field(default_factory=RouterConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.model, Path) or not str(self.model):
            raise ConfigError("model", f"must be a checkpoint directory, got {self.model!r}")
        check_choice("dtype", self.dtype, DTYPES)
        try:
            check_device_name(self.device)
        except DeviceError as exc:
            raise ConfigError("device", str(exc)) from None
        check_int("page_size", self.page_size, 1)
        check_host("worker_host", self.worker_host)
        if self.page_size & (self.page_size - 1):
            raise ConfigError("page_size", f"must be a power of two, got {self.page_size}")
        self._check_groups()
        self._check_limits(self.limits, "limits")
        for group in self.groups:
            self._check_limits(group.limits, f"groups.{group.role}.limits")
            try:
                self.engine_config(group.role)
            except ValueError as exc:  # the engine's own rules, should ours miss one
                raise ConfigError(f"groups.{group.role}", f"the engine rejects it: {exc}") from None
        self._check_model()

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
        element = _DTYPE_BYTES.get(model.torch_dtype if self.dtype == "auto" else self.dtype)
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
        limits = self.group(role).limits
        return EngineConfig(
            role=role,  # type: ignore[arg-type]  # checked against GROUP_ROLES
            page_size=self.page_size,
            num_pages=limits.num_pages,
            kv_memory_bytes=limits.kv_memory_bytes,
            max_num_seqs=limits.max_num_seqs,
            max_num_batched_tokens=limits.max_num_batched_tokens,
            enable_chunked_prefill=limits.enable_chunked_prefill,
            max_model_len=self.limits.max_model_len,
            dtype=self.dtype,
            device=self.device,
        )

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
            result = replace(result, model=Path(model).expanduser().resolve())
        if address is not None:
            with _errors_under("router"):
                router = replace(result.router, address=address)
            result = replace(result, router=router)
        if http_address is not None:
            off = http_address.strip().lower() in NO_ADDRESS_WORDS
            with _errors_under("router"):
                router = replace(result.router, http_address=None if off else http_address)
            result = replace(result, router=router)
        return result

    # --- loading --------------------------------------------------------------------------

    @classmethod
    def from_yaml(cls, path: str | Path) -> ClusterConfig:
        path = Path(path)
        try:
            raw = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # a SafeLoader
        except OSError as exc:
            raise ConfigError("", f"cannot read it: {exc.strerror or exc}", path) from None
        except yaml.YAMLError as exc:
            raise ConfigError("", f"not valid YAML: {_yaml_problem(exc)}", path) from None
        try:
            return cls.from_dict(raw, base_dir=path.parent)
        except ConfigError as exc:
            raise ConfigError(exc.path, exc.message, path) from None

    @classmethod
    def from_dict(cls, raw: object, *, base_dir: str | Path | None = None) -> ClusterConfig:
        """Parse a loaded YAML document. Relative paths resolve against ``base_dir`` (default:
        the working directory)."""
        base = Path.cwd() if base_dir is None else Path(base_dir)
        data = _section(raw, "")
        _reject_unknown(data, [f.name for f in fields(cls)], "")
        if data.get("model") is None:
            raise ConfigError("model", "required: the model's checkpoint directory")
        if data.get("groups") is None:
            raise ConfigError("groups", "required: prefill and decode, or mixed")
        model = _path(data["model"], "model", base)
        limits_data = _with_bytes(
            _section(data.get("limits"), "limits"), "kv_memory_bytes", "limits"
        )
        limits = _build(Limits, limits_data, "limits")
        groups_raw = _section(data["groups"], "groups")
        _reject_unknown(groups_raw, GROUP_ROLES, "groups")
        groups = tuple(
            _parse_group(role, groups_raw[role], limits_data)
            for role in GROUP_ROLES
            if role in groups_raw
        )
        return cls(
            model=model,
            groups=groups,
            dtype=data.get("dtype", "auto"),
            device=data.get("device", "cpu"),
            page_size=data.get("page_size", 16),
            worker_host=data.get("worker_host", "127.0.0.1"),
            limits=limits,
            transfer=_build(TransferConfig, data.get("transfer"), "transfer"),
            router=_parse_router(data.get("router"), base),
        )


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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


# --- parsing helpers ------------------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (PyYAML keeps the last one
    silently: two ``decode:`` blocks would lose the first without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r}",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line: what is wrong and where (PyYAML's own text spans several)."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem and exc.problem_mark:
        mark = exc.problem_mark
        return f"{exc.problem} at line {mark.line + 1}, column {mark.column + 1}"
    return str(exc)


@contextlib.contextmanager
def _errors_under(path: str) -> Iterator[None]:
    try:
        yield
    except ConfigError as exc:
        raise exc.under(path) from None


def _section(raw: object, path: str) -> dict[str, Any]:
    """A mapping section; an empty one (``router:`` with nothing under it) is {}."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(path, f"must be a mapping, got {type(raw).__name__}: {raw!r}")
    for key in raw:
        if not isinstance(key, str):
            raise ConfigError(path, f"keys must be strings, got {key!r}")
    return dict(raw)


def _reject_unknown(data: Mapping[str, Any], allowed: Iterable[str], path: str) -> None:
    allowed = tuple(allowed)
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                join_path(path, key), f"unknown key; {hint}expected one of {', '.join(allowed)}"
            )


def _build(
    cls: type[_T],
    raw: object,
    path: str,
    *,
    hidden: tuple[str, ...] = (),
    given: Mapping[str, Any] | None = None,
) -> _T:
    """``cls(**raw, **given)`` for a section whose keys are the dataclass's fields (less
    ``hidden``); ``given`` holds values the caller parsed itself (nested sections)."""
    data = _section(raw, path)
    names = [f.name for f in fields(cls) if f.name not in hidden]  # type: ignore[arg-type]
    _reject_unknown(data, names, path)
    with _errors_under(path):
        return cls(**{**data, **(given or {})})


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_BYTE_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
_BYTE_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def _with_bytes(data: dict[str, Any], key: str, path: str) -> dict[str, Any]:
    """``data`` with ``data[key]`` turned from ``"4GiB"`` into bytes (ints pass as they are)."""
    value = data.get(key)
    if not isinstance(value, str):
        return data
    match = _BYTE_SIZE.match(value)
    unit = _BYTE_UNITS.get(match.group(2).lower()) if match else None
    if match is None or unit is None:
        raise ConfigError(
            join_path(path, key), f"must be bytes or a size such as 512MiB or 4GiB, got {value!r}"
        )
    return {**data, key: int(float(match.group(1)) * unit)}


def _path(value: object, path: str, base: Path) -> Path:
    if not isinstance(value, str) or not value:
        raise ConfigError(path, f"must be a path, got {value!r}")
    return (base / Path(value).expanduser()).resolve()


def _parse_group(role: str, raw: object, top_limits: dict[str, Any]) -> GroupConfig:
    path = f"groups.{role}"
    data = _section(raw, path)
    override = _section(data.get("limits"), f"{path}.limits")
    _reject_unknown(override, GROUP_LIMIT_KEYS, f"{path}.limits")
    merged = dict(top_limits)
    if "num_pages" in override or "kv_memory_bytes" in override:
        # Either key sizes the KV pool: a group giving one replaces the top-level choice.
        merged.pop("num_pages", None)
        merged.pop("kv_memory_bytes", None)
    merged.update(_with_bytes(override, "kv_memory_bytes", f"{path}.limits"))
    # The top-level limits passed on their own, so an error here comes from this override.
    limits = _build(Limits, merged, f"{path}.limits")
    fabric = None
    if role != "mixed" or "fabric" in data:  # GroupConfig rejects a mixed group's fabric
        fabric = _build(FabricConfig, data.get("fabric"), f"{path}.fabric")
    resources_path = f"{path}.resources_per_rank"
    resources = _with_bytes(
        _section(data.get("resources_per_rank"), resources_path), "memory", resources_path
    )
    # Sorted pairs rather than a dict: the config stays hashable and immutable.
    custom = tuple(sorted(_section(resources.get("custom"), f"{resources_path}.custom").items()))
    resources_per_rank = _build(Resources, resources, resources_path, given={"custom": custom})
    given = {
        "role": role,
        "resources_per_rank": resources_per_rank,
        "fabric": fabric,
        "limits": limits,
    }
    return _build(GroupConfig, data, path, hidden=("role",), given=given)


def _parse_router(raw: object, base: Path) -> RouterConfig:
    data = _with_bytes(_section(raw, "router"), "max_request_bytes", "router")
    tls = _section(data.get("tls"), "router.tls")
    _reject_unknown(tls, [f.name for f in fields(TLSConfig)], "router.tls")
    tls_paths = {
        key: _path(value, f"router.tls.{key}", base)
        for key, value in tls.items()
        if value is not None
    }
    return _build(
        RouterConfig,
        data,
        "router",
        given={
            "auth": _build(AuthConfig, _with_token_file(data.get("auth"), base), "router.auth"),
            "tls": _build(TLSConfig, None, "router.tls", given=tls_paths),
        },
    )


def _with_token_file(raw: object, base: Path) -> dict[str, Any]:
    """``router.auth`` with ``token_file`` replaced by the token the file holds (surrounding
    whitespace, a trailing newline say, is not part of it)."""
    data = _section(raw, "router.auth")
    if data.get("token_file") is None:
        data.pop("token_file", None)
        return data
    path = _path(data.pop("token_file"), "router.auth.token_file", base)
    if data.get("token") is not None:
        raise ConfigError("router.auth.token_file", "give token or token_file, not both")
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ConfigError("router.auth.token_file", f"cannot read {path}: {reason}") from None
    if not token:
        raise ConfigError("router.auth.token_file", f"{path} is empty")
    return {**data, "token": token}
