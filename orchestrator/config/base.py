"""What every section of the cluster configuration shares: `ConfigError`, the `Section` base
model (frozen, unknown keys refused, no type coercion), the translation of pydantic's errors into
`ConfigError`, and the value types the YAML file spells its own way (byte sizes, choices).

Paths: a rule raised from a *field* validator names the offending key relative to that field
(usually ``""``); one raised from a *model* validator, relative to that model (``"fabric"``). The
translation joins pydantic's location with it, so every error reads ``groups.decode.tp: ...``.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import ErrorDetails, core_schema


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


def join_path(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


# --- pydantic's errors as ConfigError -------------------------------------------------------


def _got(error: ErrorDetails) -> str:
    return f"got {error.get('input')!r}"


# Pydantic error type -> how this config words it ("must be ..., got ...").
_MESSAGES: dict[str, Callable[[ErrorDetails, dict[str, Any]], str]] = {
    "missing": lambda e, c: "required",
    "extra_forbidden": lambda e, c: "unknown key",
    "int_type": lambda e, c: f"must be an integer, {_got(e)}",
    "int_from_float": lambda e, c: f"must be an integer, {_got(e)}",
    "float_type": lambda e, c: f"must be a finite number, {_got(e)}",
    "finite_number": lambda e, c: f"must be a finite number, {_got(e)}",
    "bool_type": lambda e, c: f"must be true or false, {_got(e)}",
    "string_type": lambda e, c: f"must be a string, {_got(e)}",
    "string_too_short": lambda e, c: f"must be a non-empty string, {_got(e)}",
    "greater_than_equal": lambda e, c: f"must be >= {c['ge']}, got {e.get('input')}",
    "greater_than": lambda e, c: f"must be > {c['gt']}, got {e.get('input')}",
    "less_than_equal": lambda e, c: f"must be <= {c['le']}, got {e.get('input')}",
    "less_than": lambda e, c: f"must be < {c['lt']}, got {e.get('input')}",
    "model_type": lambda e, c: f"must be a mapping, {_got(e)}",
    "tuple_type": lambda e, c: f"must be a list, {_got(e)}",
    "is_instance_of": lambda e, c: f"must be a {c.get('class', 'value of its type')}, {_got(e)}",
}


def config_error(exc: ValidationError, prefix: str = "") -> ConfigError:
    """The first of pydantic's errors, as the `ConfigError` of its dotted path."""
    error = exc.errors(include_url=False)[0]
    path = join_path(prefix, ".".join(str(part) for part in error["loc"]))
    context: dict[str, Any] = dict(error.get("ctx") or {})
    cause = context.get("error")
    if isinstance(cause, ConfigError):
        return ConfigError(join_path(path, cause.path), cause.message, cause.source)
    if isinstance(cause, BaseException):
        return ConfigError(path, str(cause))
    wording = _MESSAGES.get(error["type"])
    return ConfigError(
        path, wording(error, context) if wording else f"{error['msg']}, {_got(error)}"
    )


# --- the base of every section --------------------------------------------------------------


def reject_unknown(data: Mapping[str, Any], allowed: Iterable[str], path: str = "") -> None:
    """Refuse a key not in ``allowed``, suggesting the closest one (``tpp``: ``tp``)."""
    allowed = tuple(allowed)
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                join_path(path, key), f"unknown key; {hint}expected one of {', '.join(allowed)}"
            )


def mapping(raw: object, path: str = "") -> dict[str, Any]:
    """A mapping section; an empty one (``router:`` with nothing under it) is {}."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(path, f"must be a mapping, got {type(raw).__name__}: {raw!r}")
    for key in raw:
        if not isinstance(key, str):
            raise ConfigError(path, f"keys must be strings, got {key!r}")
    return dict(raw)


def base_dir(info: ValidationInfo) -> Path:
    """What relative paths resolve against: the YAML file's directory when loading one
    (`ClusterConfig.from_dict` passes it as validation context), else the working directory."""
    context = info.context if isinstance(info.context, Mapping) else {}
    given = context.get("base_dir")
    return Path.cwd() if given is None else Path(given)


def resolve_path(value: object, info: ValidationInfo) -> Path:
    """A path from the YAML (a non-empty string, relative to `base_dir`) or a `Path` as is."""
    if isinstance(value, Path) and str(value):
        return value
    if not isinstance(value, str) or not value:
        raise ConfigError("", f"must be a path, got {value!r}")
    return (base_dir(info) / Path(value).expanduser()).resolve()


# A path as the YAML spells it: a non-empty string (relative ones resolve with `resolve_path`).
ConfigPath = Annotated[Path, WithJsonSchema({"type": "string", "minLength": 1})]


class Section(BaseModel):
    """A frozen, validated section. Types are strict (``tp: "2"`` and ``tp: true`` are mistakes,
    not 2 and 1), unknown keys are refused with a suggestion, and an empty section (YAML's null)
    takes every default. Construction raises `ConfigError`, never pydantic's own error."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        strict=True,
        allow_inf_nan=False,
        use_attribute_docstrings=True,
    )

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise config_error(exc) from None

    # Pydantic runs an overridden __init__ for every validation, nested ones included (and
    # without the validation context, which holds the YAML file's directory). This one only
    # translates errors at the outermost call, as `pydantic.RootModel` marks its own.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Self:
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as exc:
            raise config_error(exc) from None

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, cls):
            return data
        data = mapping(data)
        reject_unknown(data, cls.model_fields)
        return data

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes``, validated again (``model_copy`` would skip the rules)."""
        return type(self)(**{**dict(self), **changes})


# --- value types --------------------------------------------------------------------------


def check_number(name: str, value: object, minimum: float, *, strict: bool = False) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ConfigError(name, f"must be a finite number, got {value!r}")
    if value < minimum or (strict and value == minimum):
        raise ConfigError(name, f"must be {'>' if strict else '>='} {minimum}, got {value}")


@dataclass(frozen=True)
class OneOf:
    """``Annotated[str, OneOf(choices)]``: one of ``choices``; an alias (a short name) stands for
    the choice it maps to and is stored as that choice."""

    choices: tuple[str, ...]
    aliases: Mapping[str, str] = field(default_factory=dict)

    def check(self, value: object) -> object:
        if isinstance(value, str):
            value = self.aliases.get(value, value)
        if value not in self.choices:
            raise ConfigError("", f"must be one of {', '.join(self.choices)}; got {value!r}")
        return value

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_before_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return {"enum": [*self.choices, *self.aliases]}


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_BYTE_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
_BYTE_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
# The sizes a JSON schema takes as strings: those `parse_bytes` reads, less the ones of no bytes
# ("0", "0.0GiB"); a fraction of a byte ("0.5B") is left to the loader (it truncates to 0).
BYTE_SIZE_PATTERN = (
    r"^\s*([0-9]*[1-9][0-9]*(\.[0-9]+)?|[0-9]+\.[0-9]*[1-9][0-9]*)\s*([kKmMgGtT]i?[bB]|[bB])?\s*$"
)


def parse_bytes(value: object) -> object:
    """``"4GiB"``, ``"1 GB"``, ``"512"`` -> bytes; anything else is left to the int check."""
    if not isinstance(value, str):
        return value
    match = _BYTE_SIZE.match(value)
    unit = _BYTE_UNITS.get(match.group(2).lower()) if match else None
    if match is None or unit is None:
        raise ConfigError("", f"must be bytes or a size such as 512MiB or 4GiB, got {value!r}")
    return int(float(match.group(1)) * unit)


def _human_bytes(count: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size and count % size == 0:
            return f" ({count // size}{unit})"
    return ""


@dataclass(frozen=True)
class Bytes:
    """``Annotated[int, Bytes(minimum, maximum)]``: bytes, as an integer or a size with a unit
    (``512MiB``, ``4GiB``, ``1GB``)."""

    minimum: int = 1
    maximum: int | None = None

    def check(self, value: int) -> int:
        if value < self.minimum:
            raise ConfigError(
                "", f"must be >= {self.minimum}{_human_bytes(self.minimum)}, got {value}"
            )
        if self.maximum is not None and value > self.maximum:
            raise ConfigError(
                "", f"must be <= {self.maximum}{_human_bytes(self.maximum)}, got {value}"
            )
        return value

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        checked = core_schema.no_info_after_validator_function(self.check, handler(source))
        return core_schema.no_info_before_validator_function(parse_bytes, checked)

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        number: dict[str, Any] = {"type": "integer", "minimum": self.minimum}
        if self.maximum is not None:
            number["maximum"] = self.maximum
        return {"oneOf": [number, {"type": "string", "pattern": BYTE_SIZE_PATTERN}]}
