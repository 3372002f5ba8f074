"""Step-time noise: the spread of measured step times around a cost model's fit.

A fitted cost model prices every step of a given shape alike, so a simulated ITL tail is only
the slowest shapes. On a served cluster the same shape takes longer now and then (another
worker's step on the same cores, the decoder admitting pushed KV, garbage collection), and
those steps are the p99 ITL (bench/history/RESULTS-notebook.md, "Simulator from step traces"). A cost model
fitted to step traces keeps, per worker role and step kind, a `Spread`: the quantiles of
measured - fitted busy-cycle time (`calibrated.CalibratedCostModel.step_noise`). The simulator
adds a draw from them to each step's price, independent from step to step, from its own
seeded generator (one simulation, one seed: the same prediction every time). Models without
a spread (roofline, a calibration run's fits) have no noise.

The spread is in seconds, not a ratio to the fit: a stall from another worker or a pause does
not grow with the step it lands in. Measured, the colocated workers' smallest third of chunk
steps had a p99 of 1.94x their fit and the largest two thirds 1.53x; one ratio spread for all
priced the large steps' tail from the small ones' and put the simulated colocated ITL p99
9% high on average, against 3.5% with residuals in seconds (bench/history/RESULTS-notebook.md, "Step-time
noise in seconds").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from orchestrator.sim.shape import StepShape

NOISE_QUANTILES = 101  # quantiles kept per (role, step kind): every percentile


def step_kind(shape: StepShape) -> str:
    """``prefill`` (chunks only), ``decode`` (decodes only) or ``mixed`` (both in one pass)."""
    if not shape.num_decode_seqs:
        return "prefill"
    return "decode" if not shape.num_prefill_tokens else "mixed"


@dataclass(frozen=True)
class Spread:
    """Measured - fitted seconds of one (role, step kind), as quantiles at evenly spaced
    probabilities; ``floor``: the lowest measured / fitted ratio (at most 1), under which a
    drawn step never goes (a residual of a large step drawn for a small one could else make
    it free or negative)."""

    floor: float
    residuals: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.residuals) < 2 or list(self.residuals) != sorted(self.residuals):
            raise ValueError("a step-time spread wants >= 2 increasing residual quantiles")
        if not 0.0 < self.floor <= 1.0:
            raise ValueError(f"a step-time spread's floor must be in (0, 1], got {self.floor}")

    @classmethod
    def measured(cls, measured: ArrayLike, fitted: ArrayLike) -> Spread:
        seconds = np.asarray(measured, dtype=float)
        fit = np.maximum(np.asarray(fitted, dtype=float), 1e-9)
        quantiles = np.quantile(seconds - fit, np.linspace(0.0, 1.0, NOISE_QUANTILES))
        floor = float(np.clip((seconds / fit).min(), 1e-3, 1.0))
        return cls(floor, tuple(float(q) for q in quantiles))


class StepNoise:
    """``spreads``: (role, step kind) -> its `Spread`."""

    def __init__(self, spreads: Mapping[tuple[str, str], Spread], seed: int) -> None:
        # (probabilities, residuals at them, floor) for the inverse-CDF draw.
        self._tables = {
            key: (np.linspace(0.0, 1.0, len(s.residuals)), np.asarray(s.residuals), s.floor)
            for key, s in spreads.items()
        }
        self._rng = np.random.default_rng(seed)

    def apply(self, role: str, shape: StepShape, seconds: float) -> float:
        """``seconds``, a step's price, plus a drawn residual of its role and kind."""
        table = self._tables.get((role, step_kind(shape)))
        if table is None:
            return seconds
        probabilities, residuals, floor = table
        drawn = seconds + float(np.interp(self._rng.random(), probabilities, residuals))
        return max(drawn, floor * seconds)


NO_NOISE = StepNoise({}, 0)  # adds nothing to any step
