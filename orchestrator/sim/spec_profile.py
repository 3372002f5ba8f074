"""Acceptance profiles from files: what our engine measured, or figures given by hand.

Three forms are read (``pdserve simulate / plan --spec-profile FILE``):

- a scrape of decode (or mixed) workers' ``/metrics``, Prometheus text, several workers'
  scrapes concatenated: ``pdserve_spec_decode_num_draft_tokens_total`` (drafts verified) and
  ``pdserve_spec_decode_num_accepted_tokens_per_pos_total{position="i"}`` (drafts kept at
  position i), summed over the series (`workers.metrics`);
- JSON of the same counters, as the engine keeps them (`workers.engine.outputs.EngineStats`):
  ``{"num_speculative_tokens": k, "num_draft_tokens": N, "num_accepted_tokens_per_pos": [...]}``;
- JSON of the conditional acceptance per draft position: ``{"acceptance": [0.87, 0.7]}``.

Either JSON may sit under a ``"speculative"`` key (so a calibration file can carry one). Step
traces and ``bench compare`` results hold no acceptance counts, so a calibrated simulation
takes its profile from such a file, not from the calibration's traces.

From counters: a verification of ``k`` drafts keeps draft i only after drafts 0..i-1, so with
V = drafts / k verifications, ``acceptance[0] = kept[0] / V`` and ``acceptance[i] = kept[i] /
kept[i-1]``. The engine verifies fewer than ``k`` drafts in a request's last steps (never past
its ``max_tokens``), so V is a slight undercount there; a ratio above 1 is read as 1.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DRAFTS_METRIC = "pdserve_spec_decode_num_draft_tokens_total"
KEPT_METRIC = "pdserve_spec_decode_num_accepted_tokens_per_pos_total"


def acceptance_from_counters(
    num_draft_tokens: float, kept_per_position: Sequence[float], k: int
) -> tuple[float, ...]:
    """Conditional acceptance of the first ``k`` draft positions (see the module docstring)."""
    if k < 1:
        raise ValueError(f"drafts per step (k) must be >= 1, got {k}")
    if num_draft_tokens <= 0:
        raise ValueError("no drafts were verified: the counters give no acceptance")
    kept = [float(c) for c in kept_per_position]
    if any(c < 0 for c in kept):
        raise ValueError(f"negative kept-draft counts: {kept}")
    kept += [0.0] * (k - len(kept))  # positions never reached keep nothing
    verifications = num_draft_tokens / k
    acceptance, before = [], verifications
    for count in kept[:k]:
        acceptance.append(min(1.0, count / before) if before else 0.0)
        before = count
    return tuple(acceptance)


def _from_json(data: Any, k: int | None, path: Path) -> tuple[float, ...]:
    if isinstance(data, dict) and isinstance(data.get("speculative"), dict):
        data = data["speculative"]
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not an acceptance profile (a JSON object)")
    if "acceptance" in data:
        values = tuple(float(a) for a in data["acceptance"])
        return _truncated(values, k, path)
    if "num_draft_tokens" in data and "num_accepted_tokens_per_pos" in data:
        drafts = data.get("num_speculative_tokens", k)
        if drafts is None:
            raise ValueError(f"{path}: give num_speculative_tokens (or --spec-k)")
        if k is not None and k > int(drafts):
            raise ValueError(f"{path}: measured with {drafts} drafts per step, not {k}")
        measured = acceptance_from_counters(
            float(data["num_draft_tokens"]), data["num_accepted_tokens_per_pos"], int(drafts)
        )
        return _truncated(measured, k, path)
    raise ValueError(
        f"{path}: want 'acceptance' or 'num_draft_tokens' and 'num_accepted_tokens_per_pos'"
    )


def _from_metrics(text: str, k: int | None, path: Path) -> tuple[float, ...]:
    from prometheus_client.parser import text_string_to_metric_families

    drafts = 0.0
    kept: dict[int, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == DRAFTS_METRIC:
                    drafts += sample.value
                elif sample.name == KEPT_METRIC:
                    position = int(sample.labels["position"])
                    kept[position] = kept.get(position, 0.0) + sample.value
    except (ValueError, KeyError) as error:
        raise ValueError(f"{path}: not Prometheus metrics text ({error})") from None
    if not drafts:
        raise ValueError(f"{path}: no {DRAFTS_METRIC} above 0 (speculative decoding off?)")
    if k is None:
        # The counters do not say how many drafts each verification carried.
        raise ValueError(f"{path}: metrics do not give drafts per step: give --spec-k")
    per_position = [kept.get(i, 0.0) for i in range(max(kept, default=-1) + 1)]
    return acceptance_from_counters(drafts, per_position, k)


def _truncated(values: tuple[float, ...], k: int | None, path: Path) -> tuple[float, ...]:
    """The first ``k`` positions: a chain's conditional acceptance does not depend on how many
    drafts follow."""
    if k is None:
        return values
    if len(values) < k:
        raise ValueError(f"{path}: acceptance of {len(values)} draft positions, not {k}")
    return values[:k]


def load_profile(path: str | Path, k: int | None = None) -> tuple[float, ...]:
    """The conditional acceptance per draft position in ``path`` (any form above), for ``k``
    drafts per step when given (the file's own count otherwise)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(f"no such acceptance profile: {path}") from None
    stripped = text.lstrip()
    if stripped.startswith(("{", "[")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not JSON ({error})") from None
        try:
            return _from_json(data, k, path)
        except (TypeError, KeyError) as error:
            raise ValueError(f"{path}: not an acceptance profile ({error!r})") from None
    return _from_metrics(text, k, path)
