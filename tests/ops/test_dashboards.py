"""Dashboards read only metrics the code exposes, in request-flow order, with the README table
in step with the panels."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.ops.metrics_contract import (
    EXPORTED_BY,
    REPO,
    WORKER_ROLES,
    family_of,
    load_contract,
)

DASHBOARD_DIR = REPO / "dashboards"
DASHBOARDS = sorted(DASHBOARD_DIR.glob("*.json"))
ROW_ORDER = ["Router", "Prefill", "KV transfer", "Decode", "Workers"]

# --- a small PromQL tokenizer: enough to find the metric names of a query --------------------

_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_TOKEN = re.compile(
    r"(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)|(?P<number>\d+(?:\.\d+)?(?:e[+-]?\d+)?)"
    r"|(?P<open>\()|(?P<close>\))|(?P<brace>\{)|(?P<bracket>\[)|(?P<other>\S)"
)
# Words followed by a parenthesised list of label names rather than an expression.
_LABEL_LIST_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS = {"and", "or", "unless", "bool", "inf", "nan", "atan2"}
_AGGREGATION_MODIFIER = re.compile(r"(by|without)\s*\(", re.IGNORECASE)
_DURATION = re.compile(r"\s*-?(?:\d+[a-z]+)+")


def _skip_to(text: str, start: int, closing: str) -> int:
    end = text.find(closing, start)
    if end < 0:
        raise ValueError(f"unclosed {closing!r} in {text!r}")
    return end + 1


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers that are not functions (followed by
    ``(``), keywords, or label names of ``by (...)`` / ``on (...)`` lists; label matchers
    ``{...}``, ranges ``[...]`` and strings are skipped."""
    text = _STRING.sub('""', expr)
    names: set[str] = set()
    position = 0
    while True:
        match = _TOKEN.search(text, position)
        if match is None:
            return names
        position = match.end()
        if match.lastgroup == "brace":
            position = _skip_to(text, position, "}")
        elif match.lastgroup == "bracket":
            position = _skip_to(text, position, "]")
        elif match.lastgroup == "ident":
            word = match.group("ident")
            following = text[position:].lstrip()
            if word.lower() in _LABEL_LIST_KEYWORDS:
                if following.startswith("("):
                    position = _skip_to(text, position, ")")
            elif word.lower() == "offset":
                duration = _DURATION.match(text, position)
                position = duration.end() if duration else position
            elif following.startswith("(") or _AGGREGATION_MODIFIER.match(following):
                continue  # a function, or an aggregation written `sum by (...) (...)`
            elif word.lower() in _KEYWORDS:
                continue
            else:
                names.add(word)


def test_tokenizer_finds_metrics_and_ignores_the_rest() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, role) (rate(a_bucket{role=~"$role", x="}"}'
        "[$__rate_interval]))) / on (instance) group_left (model) b_total offset 5m"
        " + sum without (le) (c) > bool 0.5 and d"
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c", "d"}


# --- dashboards ---------------------------------------------------------------------------------


def _load(path: Path) -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(path.read_text())
    return dashboard


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # panels of a collapsed row


def _queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def test_dashboards_exist() -> None:
    assert [path.name for path in DASHBOARDS] == ["pdserve.json"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_queries_reference_only_exposed_metrics(path: Path) -> None:
    contract = load_contract()
    used: set[str] = set()
    for title, expr in _queries(_load(path)):
        names = metric_names(expr)
        assert names, f"{title}: no metric in {expr!r}"
        for name in names:
            family = family_of(name, contract)
            assert family is not None, f"{title}: {name} is not exposed by workers/metrics.py"
            used.add(family)
    # Every exposed metric is on a dashboard: a metric nobody looks at is a missing panel.
    assert used == set(contract)


def test_unknown_metric_would_be_caught() -> None:
    contract = load_contract()
    assert family_of("pdserve_kv_pages_total", contract) is None
    assert family_of("pdserve_prompt_tokens_total_bucket", contract) is None  # not a histogram
    assert family_of("pdserve_kv_transfer_bytes_bucket", contract) == "pdserve_kv_transfer_bytes"


_SELECTOR = re.compile(r'([A-Za-z_:][A-Za-z0-9_:]*)\{((?:"(?:\\.|[^"\\])*"|[^}"])*)\}')
_MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:\\.|[^"\\])*)"')


def role_problems(expr: str) -> list[str]:
    """Selectors of ``expr`` whose ``role`` matcher picks no role that exports the metric
    (`EXPORTED_BY`): such a panel is flat zero or empty whatever the cluster does. The
    ``$role`` variable must be able to pick a worker role that exports it."""
    problems = []
    for match in _SELECTOR.finditer(expr):
        family = family_of(match.group(1), load_contract())
        if family is None:
            continue  # test_queries_reference_only_exposed_metrics names it
        exporters = EXPORTED_BY[family]
        for label, op, value in _MATCHER.findall(match.group(2)):
            if label != "role":
                continue
            if value == "$role" and op == "=~":
                candidates: tuple[str, ...] = WORKER_ROLES
            elif op == "=":
                candidates = (value,)
            elif op == "=~":
                candidates = tuple(
                    r for r in EXPORTED_BY["pdserve_num_requests_running"] if re.fullmatch(value, r)
                )
            else:
                continue
            if not set(candidates) & set(exporters):
                problems.append(
                    f"{match.group(1)}{{role{op}{value!r}}}: exported only by {', '.join(exporters)}"
                )
    return problems


def test_exported_by_covers_the_contract() -> None:
    assert set(EXPORTED_BY) == set(load_contract())


def test_role_check_catches_a_role_that_does_not_export() -> None:
    assert role_problems(
        'sum(rate(pdserve_generation_tokens_total{role="prefill", model=~"$model"}[5m]))'
    )
    assert role_problems('pdserve_kv_transfer_bytes_bucket{role="decode"}')
    assert role_problems('pdserve_router_decisions_total{role=~"$role"}')
    assert not role_problems('pdserve_prompt_tokens_total{role="router", model=~"$model"}')
    assert not role_problems('pdserve_kv_transfer_bytes_bucket{role=~"$role"}')
    assert not role_problems('pdserve_kv_pages_used{model=~"$model"}')


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_queries_select_roles_that_export_the_metric(path: Path) -> None:
    for title, expr in _queries(_load(path)):
        assert not role_problems(expr), f"{title}: {role_problems(expr)}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_queries_follow_the_conventions(path: Path) -> None:
    for title, expr in _queries(_load(path)):
        assert 'model=~"$model"' in expr, f"{title}: not filtered by the model variable"
        ranges = re.findall(r"\[[^\]]*\]", _STRING.sub('""', expr))
        assert all(r == "[$__rate_interval]" for r in ranges), f"{title}: {ranges}"
        for quantile in re.findall(r"histogram_quantile\(([^,]+),", expr):
            assert quantile.strip() in ("0.5", "0.9", "0.99"), f"{title}: {quantile}"
        if "histogram_quantile" in expr:
            assert re.search(r"sum by \(le\b", expr) and "_bucket{" in expr, title


_BY_LIST = re.compile(r"\bby\s*\(([^)]*)\)")
_LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def kept_labels(expr: str) -> set[str]:
    """Labels every series of an aggregated query still carries: those in each ``by (...)``
    list (``le`` aside, which ``histogram_quantile`` consumes); none if an aggregation has no
    ``by``. Every query of these dashboards aggregates."""
    lists = [
        {label.strip() for label in found.split(",")} - {"le"} for found in _BY_LIST.findall(expr)
    ]
    if re.search(r"\b(sum|avg|min|max|count)\s*\((?!\s*\))", expr) or not lists:
        return set()
    return set.intersection(*lists)


def test_kept_labels() -> None:
    assert kept_labels("sum by (role, reason) (rate(m[$__rate_interval]))") == {"role", "reason"}
    assert kept_labels("histogram_quantile(0.5, sum by (le, role) (rate(m_bucket[1m])))") == {
        "role"
    }
    assert kept_labels("sum by (role, x) (a) / sum by (role) (b)") == {"role"}
    assert kept_labels("sum(rate(m[1m]))") == set()


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_legends_name_only_labels_the_query_keeps(path: Path) -> None:
    # A legend `{{role}}` over `sum by (reason)` renders an empty role: the panel then merges
    # the prefill and decode series under one name without any error.
    for panel in _panels(_load(path)):
        for target in panel.get("targets", []):
            legend = set(_LEGEND_LABEL.findall(target.get("legendFormat", "")))
            missing = legend - kept_labels(target["expr"])
            assert not missing, f"{panel['title']}: legend {sorted(missing)} not kept by the query"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_layout_and_variables(path: Path) -> None:
    dashboard = _load(path)
    assert dashboard["schemaVersion"] >= 36
    rows = [panel["title"] for panel in dashboard["panels"] if panel["type"] == "row"]
    assert rows == ROW_ORDER
    ids = [panel["id"] for panel in _panels(dashboard)]
    assert len(ids) == len(set(ids))
    for panel in _panels(dashboard):
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("model", "role"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"]["uid"] == "${datasource}"
        assert metric_names(variables[name]["query"]["query"].split("(", 1)[1].rsplit(",", 1)[0])


def _readme_rows() -> dict[str, str]:
    """Panel title -> the README row that describes it."""
    rows: dict[str, str] = {}
    for line in (DASHBOARD_DIR / "README.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 4:
            rows[cells[1]] = line
    return rows


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_readme_table_lists_every_panel(path: Path) -> None:
    rows = _readme_rows()
    for panel in _panels(_load(path)):
        if panel["type"] == "row":
            continue
        assert panel["title"] in rows, f"README.md has no row for panel {panel['title']!r}"
        for _, expr in _queries({"panels": [panel]}):
            for name in metric_names(expr):
                base = family_of(name, load_contract())
                assert f"`{base}`" in rows[panel["title"]], (panel["title"], base)
