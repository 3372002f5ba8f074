"""Reading a YAML config file: safe loading, a key given twice refused, every problem a
`ConfigError` naming the file (and the line and column where the YAML is broken)."""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from orchestrator.config.base import ConfigError


def read_yaml(path: Path) -> object:
    """The document in ``path``, as plain Python values."""
    try:
        return yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # a SafeLoader
    except OSError as exc:
        raise ConfigError("", f"cannot read it: {exc.strerror or exc}", path) from None
    except yaml.YAMLError as exc:
        raise ConfigError("", f"not valid YAML: {_yaml_problem(exc)}", path) from None


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
