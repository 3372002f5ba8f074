"""Toy cost models for the simulator and planner tests: affine step times, numbers chosen so
that the right answer is obvious by hand."""

from __future__ import annotations

from orchestrator.sim.calibrated import CalibratedCostModel


def affine(
    *,
    prefill: tuple[float, float, float] = (0.002, 1e-5, 0.0),
    decode: tuple[float, float, float] = (0.005, 2e-4, 1e-7),
    capacity: int = 1 << 20,
    overhead: tuple[float, float] = (0.0, 0.0),
) -> CalibratedCostModel:
    return CalibratedCostModel(
        num_layers=4,
        kv_bytes_per_token=1024.0,
        kv_capacity_per_rank=capacity,
        prefill_coefficients=prefill,
        decode_coefficients=decode,
        transfer_coefficients=(1e-4, 1e-9),
        request_overhead_s=overhead,
        source="toy",
    )
