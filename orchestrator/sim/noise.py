"""Step-time noise: the spread of measured step times around a cost model's fit.

A fitted cost model prices every step of a given shape alike, so a simulated ITL tail is only
the slowest shapes. On a served cluster the same shape takes longer now and then (another
worker's step on the same cores, the decoder admitting pushed KV, garbage collection), and
those steps are the p99 ITL (bench/RESULTS.md, "Simulator from step traces"). A cost model
fitted to step traces keeps, per worker role and step kind, the quantiles of measured / fitted
busy-cycle time (`calibrated.CalibratedCostModel.step_noise`); the simulator multiplies each
step's price by a draw from them, independent from step to step, from its own seeded generator
(one simulation, one seed: the same prediction every time). Models without such quantiles
(roofline, a calibration run's fits) have no noise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike

from orchestrator.sim.cost import StepShape

NOISE_QUANTILES = 101  # quantiles kept per (role, step kind): every percentile


def step_kind(shape: StepShape) -> str:
    """``prefill`` (chunks only), ``decode`` (decodes only) or ``mixed`` (both in one pass)."""
    if not shape.num_decode_seqs:
        return "prefill"
    return "decode" if not shape.num_prefill_tokens else "mixed"


def ratio_quantiles(measured: ArrayLike, fitted: ArrayLike) -> tuple[float, ...]:
    ratios = np.asarray(measured, dtype=float) / np.maximum(np.asarray(fitted, dtype=float), 1e-9)
    return tuple(float(q) for q in np.quantile(ratios, np.linspace(0.0, 1.0, NOISE_QUANTILES)))


class StepNoise:
    """``quantiles``: (role, step kind) -> ratio quantiles at evenly spaced probabilities."""

    def __init__(self, quantiles: Mapping[tuple[str, str], Sequence[float]], seed: int) -> None:
        for key, values in quantiles.items():
            if len(values) < 2 or min(values) <= 0 or list(values) != sorted(values):
                raise ValueError(f"step noise {key}: want >= 2 increasing positive quantiles")
        # (probabilities, quantiles at them) for the inverse-CDF draw.
        self._tables = {
            key: (np.linspace(0.0, 1.0, len(values)), np.asarray(values, dtype=float))
            for key, values in quantiles.items()
        }
        self._rng = np.random.default_rng(seed)

    def factor(self, role: str, shape: StepShape) -> float:
        table = self._tables.get((role, step_kind(shape)))
        if table is None:
            return 1.0
        return float(np.interp(self._rng.random(), *table))


NO_NOISE = StepNoise({}, 0)  # a factor of 1 for every step
