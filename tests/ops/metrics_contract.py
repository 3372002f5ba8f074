"""The golden metric list (``workers/metrics_contract.json``), shared by the ops tests."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONTRACT_PATH = REPO / "workers" / "metrics_contract.json"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


@dataclass(frozen=True)
class ContractEntry:
    name: str
    type: str
    labels: tuple[str, ...]


def load_contract() -> dict[str, ContractEntry]:
    rows = json.loads(CONTRACT_PATH.read_text())
    return {
        row["name"]: ContractEntry(row["name"], row["type"], tuple(row["labels"])) for row in rows
    }


def family_of(series_name: str, contract: dict[str, ContractEntry]) -> str | None:
    """The contract name a scraped or queried series belongs to (``x_bucket`` -> ``x`` for
    histograms), or None when it is not in the contract."""
    if series_name in contract:
        return series_name
    for suffix in HISTOGRAM_SUFFIXES:
        base = series_name.removesuffix(suffix)
        entry = contract.get(base) if base != series_name else None
        if entry is not None and entry.type == "histogram":
            return base
    return None
