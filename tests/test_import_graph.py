"""The product's import graph: no cycles, and no edge that points up the architecture.

The layers, bottom to top: the engine and the fabric (each standing alone), the KV transfer
(`workers.kv`), the worker process (`workers.service`), and the orchestrator. A module may
import only from its own layer or below; the router in particular never reaches into the worker
process, and talks to it only through `workers.wire`. The graph is read from the sources (ast),
so lazy imports inside functions count too: they still run.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("orchestrator", "workers", "protos")

CONTROL_PLANE = (
    "orchestrator.control.app",
    "orchestrator.control.controller",
    "orchestrator.control.launch",
    "orchestrator.control.placement",
)
# (importer prefix, forbidden imported prefixes)
FORBIDDEN: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("workers.engine", ("workers.kv", "workers.service", "workers.fabric", "orchestrator")),
    ("workers.fabric", ("workers.kv", "workers.service", "workers.engine", "orchestrator")),
    ("workers.kv", ("workers.service", "orchestrator")),
    ("workers.service", ("orchestrator",)),
    ("workers.wire", ("workers.service", "workers.kv", "orchestrator")),
    ("workers.netaddr", ("workers.service", "workers.kv", "workers.engine", "orchestrator")),
    ("workers.token_auth", ("workers.service", "workers.kv", "workers.engine", "orchestrator")),
    ("workers.metrics", ("workers.service", "workers.kv", "orchestrator")),
    # The router and the API read the registry (the controller writes it), nothing else of the
    # control plane.
    ("orchestrator.router", ("workers.service", "workers.kv", *CONTROL_PLANE)),
    ("orchestrator.api", ("workers.service", "workers.kv", *CONTROL_PLANE)),
    ("orchestrator.config", ("workers.service", "workers.kv", "orchestrator.control")),
    ("orchestrator.sim", ("workers.service", "workers.kv", "orchestrator.control")),
    ("orchestrator.loadgen", ("workers.service", "workers.kv")),
    ("protos", ("workers", "orchestrator")),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def product_modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            modules[module_name(path)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The product modules `name` imports (``from a import b`` counts ``a.b`` when that is a
    module, else ``a``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = product_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan). A package's
    ``__init__`` importing its own modules is not an edge back up, so parents are skipped."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def edges(node: str) -> set[str]:
        return {t for t in graph.get(node, set()) if not _within(node, t)}

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges(node)):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def forbidden_edges(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for importer, targets in sorted(graph.items()):
        for prefix, banned in FORBIDDEN:
            if not _within(importer, prefix):
                continue
            bad.extend(
                f"{importer} -> {target}"
                for target in sorted(targets)
                if any(_within(target, b) for b in banned)
            )
    return bad


def test_the_product_has_no_import_cycle() -> None:
    assert find_cycles(import_graph()) == []


def test_no_module_imports_up_the_layers() -> None:
    assert forbidden_edges(import_graph()) == []


def test_the_checks_see_a_cycle_and_an_upward_edge() -> None:
    graph = {
        "workers.engine.a": {"workers.engine.b"},
        "workers.engine.b": {"workers.engine.a", "workers.kv.x"},
        "workers.kv.x": set(),
    }
    assert find_cycles(graph) == [["workers.engine.a", "workers.engine.b"]]
    assert forbidden_edges(graph) == ["workers.engine.b -> workers.kv.x"]


def test_the_graph_reads_lazy_and_relative_imports() -> None:
    graph = import_graph()
    assert "workers.wire" in graph["orchestrator.router.core"]
    assert "workers.service.factory" in graph["workers.service.actor"]  # inside a method
