"""Calibrated cost model: affine fits of step and transfer times measured on this machine.

The measurements file (written by ``pdserve calibrate``, `calibrate.run_calibration`)::

    {"model": "small", "num_layers": 6, "kv_bytes_per_token": 12288,
     "kv_capacity_tokens": 65536,
     "prefill":  [{"tokens": 64, "context": 0, "seconds": 0.004}, ...],
     "decode":   [{"batch": 4, "kv_tokens": 160, "seconds": 0.003}, ...],
     "transfer": [{"bytes": 1048576, "seconds": 0.0007}, ...],      # optional
     "overheads": {"disaggregated_s": 0.12, "mixed_s": 0.05,           # optional
                   "disaggregated_token_s": 0.0004, "mixed_token_s": 0.0, ...}}

``overheads`` are fixed per-request seconds outside engine steps (router, RPCs, the first
message, the decoder's KV admission) and the mean of each streamed message's varying delay on
its way to the client (``*_token_s``, `delivery`), derived by ``pdserve calibrate
--overheads-from`` from a measured run (`orchestrator.loadgen.overheads`); absent, they are 0.

Fits (least squares, coefficients kept >= 0 by dropping a feature that comes out negative):
prefill = a + b * tokens + c * attention (attention = the positions the chunk's tokens attend
to); decode = a + b * batch + c * kv_tokens; transfer = a + bytes / bandwidth (no points: free).
A mixed step pays the larger intercept once plus every variable term. A verified draft is
priced as one more decode row over its sequence's context, which a fit to a speculating run's
step traces measures (they count each verified draft as a decode row: `trace_fit`); a position
of the MTP module as one layer's share of a token (`CalibratedCostModel._price`), an
assumption no calibration has measured yet.

Shared cores: a calibration taken with ``--concurrent N`` (``"contention": {"processes": N}``)
holds its points measured while N - 1 other engine processes stepped, and under ``"alone"``
the same points measured alone. Both are fitted; a step is priced between the two in
proportion to the other instances in a step when it starts (``len(busy_others) / (N - 1)``, at
most 1), as the cluster's worker processes share this machine's cores. The machine measured
has one rank: for ``tp > 1`` the variable terms are divided by ``tp`` (ideal scaling) and
``tp_step_overhead_s`` is added per step, an assumption to replace with measurements.

Per-role fits (a file written by ``pdserve calibrate --from-trace``, `trace_fit`): under
``"roles"``, points ``[prefill_tokens, prefill_attention, decode_seqs, decode_kv_tokens,
seconds]`` of the busy cycles of a served cluster's prefill, decode or mixed workers. Each
role gets one affine fit of all four terms, and an instance of that role is priced with it
alone: the points were measured inside the cluster, so its contention is in them and
``busy_others`` plays no part, unless the file has ``"shared_cores"`` (``--shared-cores C``):
then the points are core-seconds, and the simulator runs a step priced alone at its share of
a core, re-divided among the steps in progress as they start and end, weighed by their roles'
CPU priorities (`shared_cores.ProcessorSharing`); ``step_seconds`` given ``busy_others``
stretches the step by the share it would get if they all kept stepping for its length. The
points' spread around their role's fit, as quantiles of measured - fitted seconds per step
kind (`noise.Spread`), is the model's ``step_noise``: the simulator adds a draw from it to
each step's price. Such a file needs no ``"prefill"`` /
``"decode"`` points: the role-less fits (for a role the traces lack) are taken from its
prefill-only and decode-only cycles.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator.sim.cost import StepShape
from orchestrator.sim.noise import Spread, step_kind
from orchestrator.sim.shared_cores import SharedCores

# Intercept, per prefill token, per attention position, per decode sequence, per KV token.
RoleFit = tuple[float, float, float, float, float]
# The smallest step of each kind, and the kinds each role's instances run (`instances`).
_SMALLEST_STEPS = {
    "prefill": StepShape(num_prefill_tokens=1, num_prefill_attention=1),
    "decode": StepShape(num_decode_seqs=1, num_decode_kv_tokens=1),
}
_ROLE_STEP_KINDS = {"prefill": ("prefill",), "decode": ("decode",)}
MIN_ROLE_POINTS = 5  # points a role needs for a fit of its 5 terms
MIN_NOISE_POINTS = 20  # traced steps of one role and kind that give its spread


@dataclass(frozen=True)
class CalibratedCostModel:
    num_layers: int
    kv_bytes_per_token: float
    kv_capacity_per_rank: int
    prefill_coefficients: tuple[float, float, float]  # intercept, per token, per attention
    decode_coefficients: tuple[float, float, float]  # intercept, per sequence, per KV token
    transfer_coefficients: tuple[float, float] = (0.0, 0.0)  # intercept, seconds per byte
    tp_step_overhead_s: float = 0.0
    request_overhead_s: tuple[float, float] = (0.0, 0.0)  # disaggregated, mixed
    token_delay_s: tuple[float, float] = (0.0, 0.0)  # disaggregated, mixed (`delivery`)
    # Fits of the same engine measured alone (prefill, decode), when the main ones were
    # measured while contention_processes - 1 other engine processes stepped.
    alone_coefficients: tuple[tuple[float, float, float], tuple[float, float, float]] | None = None
    contention_processes: int = 1
    # Fits of a served cluster's steps by worker role; see the module docstring.
    role_coefficients: tuple[tuple[str, RoleFit], ...] = ()
    # Spread of measured - fitted busy cycles by (role, step kind): `noise.StepNoise`.
    step_noise_spreads: tuple[tuple[tuple[str, str], Spread], ...] = ()
    # The fits' seconds are core-seconds of processes sharing these cores (`shared_cores`).
    shared_cores: SharedCores | None = None
    max_tp: int = 8
    source: str = "calibrated"
    # Arrivals per second of the runs a trace fit came from (`trace_fit`): steps priced at one
    # load are off at another (`load_mismatch`).
    traced_rates: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        coefficients: tuple[float, ...] = (
            *self.prefill_coefficients,
            *self.decode_coefficients,
            *self.transfer_coefficients,
        )
        if self.alone_coefficients is not None:
            coefficients += (*self.alone_coefficients[0], *self.alone_coefficients[1])
            if self.contention_processes < 2:
                raise ValueError("fits measured alone need a contention of >= 2 processes")
        for _, role_fit in self.role_coefficients:
            coefficients += role_fit
        numbers = (
            *coefficients,
            *self.request_overhead_s,
            *self.token_delay_s,
            self.tp_step_overhead_s,
            self.kv_bytes_per_token,
        )
        # NaN passes every comparison below, and an infinity prices steps (or KV) at infinity.
        if not all(math.isfinite(number) for number in numbers):
            raise ValueError(
                f"cost coefficients, overheads and kv_bytes_per_token must be finite, got {numbers}"
            )
        if min(coefficients) < 0 or min(*self.request_overhead_s, *self.token_delay_s) < 0:
            raise ValueError(f"cost coefficients must be >= 0, got {coefficients}")
        if self.num_layers < 1 or self.kv_bytes_per_token <= 0 or self.kv_capacity_per_rank < 1:
            raise ValueError("num_layers, kv_bytes_per_token and kv_capacity must be positive")
        self._check_step_prices()

    def _check_step_prices(self) -> None:
        """`CostModel`'s contract: every step takes time. A fit of measurements that are all
        <= 0 comes out as zero coefficients (`fit_affine` keeps them >= 0), and would run
        steps for free; each fit must price the smallest step of each kind it prices > 0."""
        fits = [("the", self.prefill_coefficients, self.decode_coefficients, "")]
        if self.alone_coefficients is not None:
            fits.append(("the alone", *self.alone_coefficients, ""))
        for role, (a, per_token, per_attention, per_seq, per_kv) in self.role_coefficients:
            fits.append((f"the {role}", (a, per_token, per_attention), (a, per_seq, per_kv), role))
        for name, prefill, decode, role in fits:
            for kind in _ROLE_STEP_KINDS.get(role, ("prefill", "decode")):
                seconds = self._price(prefill, decode, _SMALLEST_STEPS[kind], 1)
                if seconds <= 0:
                    raise ValueError(
                        f"{name} fit prices a {kind} step at {seconds} s: step times must be "
                        "positive (are the measured seconds <= 0?)"
                    )

    @property
    def name(self) -> str:
        return self.source

    def step_seconds(
        self,
        shape: StepShape,
        tp: int,
        busy_others: Sequence[str] = (),
        role: str | None = None,
    ) -> float:
        if self.shared_cores is None:
            return self._seconds(shape, tp, len(busy_others), role)
        # Every fit in core-seconds: stretched by the share of a core this step gets.
        slowdown = self.shared_cores.slowdown(role or "", busy_others)
        return self._seconds(shape, tp, 0, role) * slowdown

    def _seconds(self, shape: StepShape, tp: int, busy_others: int, role: str | None) -> float:
        role_fit = self._role_fit_of.get(role or "")
        if role_fit is not None:
            # One intercept for every step of the role, whatever its kind.
            a, per_token, per_attention, per_seq, per_kv = role_fit
            return self._price((a, per_token, per_attention), (a, per_seq, per_kv), shape, tp)
        contended = self._price(self.prefill_coefficients, self.decode_coefficients, shape, tp)
        if self.alone_coefficients is None:
            return contended
        # Measured alone and with every other process stepping: in between, in proportion
        # to the other instances in a step (the calibration's processes share the cores).
        alone = self._price(*self.alone_coefficients, shape, tp)
        share = min(1.0, busy_others / max(1, self.contention_processes - 1))
        return alone + share * max(0.0, contended - alone)

    def _price(
        self,
        prefill: tuple[float, float, float],
        decode: tuple[float, float, float],
        shape: StepShape,
        tp: int,
    ) -> float:
        p0, p_token, p_attention = prefill
        d0, d_seq, d_kv = decode
        intercept = max(
            p0 if shape.num_prefill_tokens else 0.0, d0 if shape.num_decode_seqs else 0.0
        )
        variable = (
            p_token * shape.num_prefill_tokens
            + p_attention * shape.num_prefill_attention
            + d_seq * shape.num_decode_seqs
            + d_kv * shape.num_decode_kv_tokens
        )
        # Speculative decoding: a draft is one more decode row reading its sequence's context
        # (the per-sequence and per-KV-token terms, as step traces count it), and an MTP
        # position one layer of a token's pass (the per-token cost of whichever role the fit
        # has; not measured).
        per_token = max(p_token, d_seq)
        variable += (
            d_seq * shape.num_draft_tokens
            + d_kv * shape.num_draft_attention
            + per_token * shape.num_mtp_tokens / self.num_layers
        )
        overhead = self.tp_step_overhead_s if tp > 1 else 0.0
        return intercept + variable / tp + overhead

    @functools.cached_property
    def _role_fit_of(self) -> dict[str, RoleFit]:
        return dict(self.role_coefficients)

    def step_noise(self) -> dict[tuple[str, str], Spread]:
        return dict(self.step_noise_spreads)

    def request_overhead_seconds(self, disaggregated: bool) -> float:
        return self.request_overhead_s[0 if disaggregated else 1]

    def token_delay_seconds(self, disaggregated: bool) -> float:
        return self.token_delay_s[0 if disaggregated else 1]

    def without_overheads(self) -> CalibratedCostModel:
        """The same steps, with no cost outside them (the reference overheads are fit to)."""
        return self.with_overheads({})

    def with_overheads(self, overheads: dict[str, Any]) -> CalibratedCostModel:
        """The same steps, with the costs outside them of an ``overheads`` entry (absent: 0)."""
        request, token = _overheads(overheads)
        return replace(self, request_overhead_s=request, token_delay_s=token)

    def kv_bytes(self, num_tokens: int) -> int:
        return int(self.kv_bytes_per_token * num_tokens)

    def transfer_seconds(self, num_tokens: int, tp_prefill: int, tp_decode: int) -> float:
        intercept, per_byte = self.transfer_coefficients
        return intercept + per_byte * self.kv_bytes(num_tokens)

    def kv_capacity_tokens(self, tp: int) -> int:
        return self.kv_capacity_per_rank * tp

    def supports_tp(self, tp: int) -> bool:
        return 1 <= tp <= self.max_tp

    def spread_experts(self, instances: int) -> CalibratedCostModel:
        if instances == 1:
            return self
        # The fit measured pdserve's engine, which keeps every expert in each instance.
        raise ValueError(
            f"{self.source}: a calibrated model prices instances as they were measured; it "
            "cannot price experts spread over instances (use a roofline model)"
        )


def fit_affine(features: np.ndarray, seconds: np.ndarray) -> tuple[float, ...]:
    """Least squares of ``seconds`` on [1, features...], coefficients >= 0: a feature whose
    coefficient comes out negative (noise on a small term) is dropped and the rest refit."""
    if not (np.isfinite(features).all() and np.isfinite(seconds).all()):
        raise ValueError("measurements must be finite numbers (NaN or Infinity in the points)")
    columns = np.column_stack([np.ones(len(seconds)), features])
    active = list(range(columns.shape[1]))
    while True:
        solution = np.linalg.lstsq(columns[:, active], seconds, rcond=None)[0]
        if solution.min() >= 0 or len(active) == 1:
            break
        del active[int(np.argmin(solution))]
    coefficients = np.zeros(columns.shape[1])
    coefficients[active] = np.maximum(solution, 0.0)
    return tuple(float(c) for c in coefficients)


def _attention(tokens: int, context: int) -> int:
    return tokens * context + tokens * (tokens + 1) // 2


def _point_attention(point: dict[str, float]) -> float:
    """A prefill point's attention: given (traced points), or from its context (measured)."""
    if "attention" in point:
        return point["attention"]
    return _attention(int(point["tokens"]), int(point["context"]))


Coefficients = tuple[float, float, float]


def _fit_steps(
    prefill: Sequence[dict[str, float]], decode: Sequence[dict[str, float]]
) -> tuple[Coefficients, Coefficients]:
    if len(prefill) < 3 or len(decode) < 3:
        raise ValueError("need at least 3 prefill and 3 decode measurements to fit 3 terms")
    p = fit_affine(
        np.array([[m["tokens"], _point_attention(m)] for m in prefill]),
        np.array([m["seconds"] for m in prefill]),
    )
    d = fit_affine(
        np.array([[m["batch"], m["kv_tokens"]] for m in decode]),
        np.array([m["seconds"] for m in decode]),
    )
    return (p[0], p[1], p[2]), (d[0], d[1], d[2])


NoiseSpreads = tuple[tuple[tuple[str, str], Spread], ...]


def _role_fits(
    roles: dict[str, list[list[float]]],
) -> tuple[tuple[tuple[str, RoleFit], ...], NoiseSpreads]:
    """Each role's fit, and the spread of its points around it by step kind (a kind needs
    `MIN_NOISE_POINTS` points of the role; fewer: that kind's steps get no noise)."""
    fits, noise = [], []
    for role, points in sorted(roles.items()):
        rows = np.array(points, dtype=float)
        if rows.ndim != 2 or rows.shape[1] != 5 or len(rows) < MIN_ROLE_POINTS:
            raise ValueError(f"roles.{role}: want >= {MIN_ROLE_POINTS} points of 5 numbers each")
        a, b, c, d, e = fit_affine(rows[:, :4], rows[:, 4])
        fits.append((role, (a, b, c, d, e)))
        fitted = a + rows[:, :4] @ np.array([b, c, d, e])
        kinds = [step_kind(StepShape(*map(int, row[:4]))) for row in rows]
        for kind in sorted(set(kinds)):
            chosen = [k == kind for k in kinds]
            if sum(chosen) >= MIN_NOISE_POINTS:
                noise.append(((role, kind), Spread.measured(rows[chosen, 4], fitted[chosen])))
    return tuple(fits), tuple(noise)


def _split_role_points(
    roles: dict[str, list[list[float]]],
) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """The prefill-only and decode-only points of every role, in the measured points' form."""
    prefill, decode = [], []
    for points in roles.values():
        for tokens, attention, seqs, kv, seconds in points:
            if not seqs:
                prefill.append({"tokens": tokens, "attention": attention, "seconds": seconds})
            elif not tokens:
                decode.append({"batch": seqs, "kv_tokens": kv, "seconds": seconds})
    return prefill, decode


def fit(data: dict[str, Any], source: str = "calibrated") -> CalibratedCostModel:
    roles = data.get("roles") or {}
    prefill: Sequence[dict[str, float]]
    decode: Sequence[dict[str, float]]
    if "prefill" in data or not roles:
        prefill, decode = data["prefill"], data["decode"]
    else:
        prefill, decode = _split_role_points(roles)
    p, d = _fit_steps(prefill, decode)
    role_fits, noise = _role_fits(roles)
    alone = None
    if data.get("alone"):
        alone = _fit_steps(data["alone"]["prefill"], data["alone"]["decode"])
    transfer = data.get("transfer") or []
    t = (0.0, 0.0)
    if len(transfer) >= 2:
        intercept, per_byte = fit_affine(
            np.array([[m["bytes"]] for m in transfer]), np.array([m["seconds"] for m in transfer])
        )
        t = (intercept, per_byte)
    request, token = _overheads(data.get("overheads") or {})
    return CalibratedCostModel(
        num_layers=int(_finite(data["num_layers"], "num_layers")),
        kv_bytes_per_token=_finite(data["kv_bytes_per_token"], "kv_bytes_per_token"),
        kv_capacity_per_rank=int(_finite(data["kv_capacity_tokens"], "kv_capacity_tokens")),
        prefill_coefficients=p,
        decode_coefficients=d,
        transfer_coefficients=t,
        request_overhead_s=request,
        token_delay_s=token,
        alone_coefficients=alone,
        contention_processes=int(
            _finite((data.get("contention") or {}).get("processes", 1), "contention.processes")
        ),
        role_coefficients=role_fits,
        step_noise_spreads=noise,
        shared_cores=_shared_cores(data.get("shared_cores")),
        source=source,
        traced_rates=tuple(
            _finite(rate, "from_trace.rates")
            for rate in (data.get("from_trace") or {}).get("rates", ())
        ),
    )


# How far a planned or simulated rate may lie from the traced ones before `load_mismatch` says.
LOAD_TOLERANCE = 1.5


def load_mismatch(model: object, rate: float) -> str | None:
    """A warning when ``model`` was fitted to traces of runs at rates far from ``rate``
    (beyond `LOAD_TOLERANCE` times either way); None otherwise, or for a model with no
    traced rates. Measured steps take another time under another load: the other processes'
    share of shared cores, caches, the batch shapes the load makes. A calibration traced at
    low load prices a loaded cluster's steps high, and the reverse."""
    rates = getattr(model, "traced_rates", ())
    if not rates or min(rates) / LOAD_TOLERANCE <= rate <= max(rates) * LOAD_TOLERANCE:
        return None
    low, high = min(rates), max(rates)
    traced = f"{low:g}" if low == high else f"{low:g}-{high:g}"
    return (
        f"the calibration's steps were traced at {traced} req/s and this is {rate:.3g} req/s: "
        "steps run at another speed under another load, so prices may be off; trace runs near "
        f"{rate:.3g} req/s (pdserve bench compare --rate {rate:.3g} ... --json OUT) and "
        "calibrate on those (pdserve calibrate --from-trace OUT ...)"
    )


def _overheads(section: dict[str, Any]) -> tuple[tuple[float, float], tuple[float, float]]:
    """The request overheads and token delays of an ``overheads`` entry (disaggregated, mixed;
    absent keys: 0)."""

    def pair(disaggregated: str, mixed: str) -> tuple[float, float]:
        return (
            _finite(section.get(disaggregated, 0.0), f"overheads.{disaggregated}"),
            _finite(section.get(mixed, 0.0), f"overheads.{mixed}"),
        )

    return pair("disaggregated_s", "mixed_s"), pair("disaggregated_token_s", "mixed_token_s")


def _shared_cores(section: dict[str, Any] | None) -> SharedCores | None:
    if section is None:
        return None
    nice = tuple(
        (str(role), int(_finite(level, f"shared_cores.nice.{role}")))
        for role, level in sorted(section["nice"].items())
    )
    return SharedCores(_finite(section["cores"], "shared_cores.cores"), nice)


def _finite(value: Any, name: str) -> float:
    """``value`` as a float; ValueError for NaN or an infinity (JSON's ``NaN``, ``Infinity``,
    or a number too large for a float), which `int` or the cost arithmetic would choke on."""
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return number


def mixed_errors(model: CalibratedCostModel, data: dict[str, Any]) -> list[float]:
    """(predicted - measured) / measured of the file's mixed points (chunk steps with decodes
    in them): how well the fit prices a colocated worker's stall steps. Empty without them."""
    errors = []
    for m in data.get("mixed") or []:
        tokens, batch = int(m["tokens"]), int(m["batch"])
        shape = StepShape(
            tokens, _attention(tokens, int(m["context"])), batch, int(m["kv_tokens"]) + batch
        )
        # Measured while the calibration's other processes stepped.
        others = ("mixed",) * (model.contention_processes - 1)  # the engines measured beside it
        predicted = model.step_seconds(shape, 1, others)
        errors.append((predicted - m["seconds"]) / m["seconds"])
    return errors


def load(path: str | Path) -> CalibratedCostModel:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error})") from None
    try:
        return fit(data, source=f"calibrated from {path.name}")
    except (KeyError, TypeError, AttributeError) as error:  # a JSON of another shape
        raise ValueError(f"{path}: not a pdserve calibrate file ({error!r})") from None
    except ValueError as error:  # numbers it cannot fit (non-finite, no step time, ...)
        raise ValueError(f"{path}: {error}") from None


def from_spec(args: list[str]) -> CalibratedCostModel:
    """``PATH`` of a measurements JSON (a path may itself contain ':')."""
    if not args or not args[0]:
        raise ValueError("calibrated needs the measurements file: calibrated:PATH")
    return load(":".join(args))
