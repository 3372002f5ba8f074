"""Step-time cost models: the contract the simulator prices engine steps and KV transfers with.

A model prices one engine step of one instance (a TP group) from its `StepShape`: prefill
tokens (chunks of prompts) and decode sequences in the same forward pass, with speculative
decoding the drafts they verify and the MTP module's passes that propose them. Prefill-only and
decode-only steps are the special cases `prefill_seconds` / `decode_seconds`; a mixed step
pays for both in one pass, which is exactly how a prefill chunk stalls a decode batch.

Implementations: `roofline.RooflineCostModel` (GPU / NIC / model presets) and
`calibrated.CalibratedCostModel` (affine fit of measurements on this machine). The registry
resolves a spec string (``roofline:MODEL:GPU[:NIC]``, ``calibrated:PATH``) and imports the
implementation lazily. `StepShape` lives in `shape` (re-exported here), so that `noise`, which
draws per step shape, does not import this module back.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from orchestrator.sim.shape import StepShape

if TYPE_CHECKING:
    from orchestrator.sim.noise import Spread
    from orchestrator.sim.shared_cores import SharedCores


class CostModel(Protocol):
    """Prices steps and transfers of one model on one kind of hardware.

    Contract: times are seconds, positive, and non-decreasing in every field of the step
    shape (the simulator's monotonicity relies on it); ``tp`` is the instance's TP size and
    ``supports_tp`` says whether the model runs (fits, shards) at that size.
    """

    @property
    def name(self) -> str: ...

    @property
    def num_layers(self) -> int:
        """Layers of the model: the layer-wise push exposes 1 / num_layers of a transfer."""
        ...

    def step_seconds(
        self,
        shape: StepShape,
        tp: int,
        busy_others: Sequence[str] = (),
        role: str | None = None,
    ) -> float:
        """Wall time of one engine step of an instance of ``tp`` ranks, while the other
        instances of the cluster whose roles ``busy_others`` lists are in a step (it matters
        only to a model of instances that share one machine's cores, which counts them or
        weighs them by their CPU priority; the others ignore it). ``role``: the instance's
        (``prefill``, ``decode``, ``mixed``), for a model fitted per role (a calibration from
        step traces); the others ignore it."""
        ...

    def step_noise(self) -> Mapping[tuple[str, str], Spread]:
        """Spread of measured step times around ``step_seconds``: (role, step kind) -> its
        `noise.Spread`; empty for a model without measurements of a served cluster."""
        ...

    def kv_bytes(self, num_tokens: int) -> int:
        """Bytes of KV cache of ``num_tokens`` tokens (all layers, all heads, one copy)."""
        ...

    def transfer_seconds(self, num_tokens: int, tp_prefill: int, tp_decode: int) -> float:
        """Time to move the KV of ``num_tokens`` from a prefill to a decode instance, if it
        were sent after prefill ended (no layer-wise overlap; see `exposed_transfer_seconds`)."""
        ...

    def kv_capacity_tokens(self, tp: int) -> int:
        """KV tokens one instance can hold; <= 0 when the weights alone do not fit."""
        ...

    def supports_tp(self, tp: int) -> bool: ...

    @property
    def shared_cores(self) -> SharedCores | None:
        """The one machine's cores every instance shares (a calibration with
        ``--shared-cores``), and each role's CPU priority; None: instances have their own."""
        ...

    def spread_experts(self, instances: int) -> CostModel:
        """The model for an instance of an expert-parallel domain of ``instances`` instances
        that keep one copy of the routed experts between them (itself when ``instances`` is
        1); ValueError when it cannot price that (no routed experts, or a fit of instances
        that did not)."""
        ...

    def request_overhead_seconds(self, disaggregated: bool) -> float:
        """Fixed time a request spends outside engine steps before its first token: router,
        RPCs, the first message's way back and, disaggregated, the decoder's admission of the
        pushed KV. The simulator delays each arrival by it."""
        ...

    def token_delay_seconds(self, disaggregated: bool) -> float:
        """Mean of the varying part of a streamed message's delay on its way to the client
        (`delivery`): the simulator widens and narrows the gaps between a request's tokens by
        it; 0: the gaps are the engine's steps."""
        ...


def prefill_seconds(model: CostModel, num_tokens: int, num_context: int, tp: int) -> float:
    """One prefill chunk of ``num_tokens`` after ``num_context`` tokens already in the cache."""
    attention = num_tokens * num_context + num_tokens * (num_tokens + 1) // 2
    return model.step_seconds(StepShape(num_tokens, attention), tp)


def decode_seconds(model: CostModel, batch: int, num_kv_tokens: int, tp: int) -> float:
    return model.step_seconds(
        StepShape(num_decode_seqs=batch, num_decode_kv_tokens=num_kv_tokens), tp
    )


def exposed_transfer_seconds(total: float, overlap: float, num_layers: int) -> float:
    """The part of a layer-wise KV push that the request waits for after its prefill ends.

    Layer l's pages leave as soon as layer l is computed (docs/design.md §3.4), so with a link
    faster than the compute only the last layer's share, ``total / num_layers``, is exposed.
    With a slower link the pushes queue behind each other: what remains after the first
    ``num_layers - 1`` layers' compute (``overlap`` seconds of prefill in all) is exposed.
    """
    if total < 0 or overlap < 0 or num_layers < 1:
        raise ValueError(f"bad transfer: total={total}, overlap={overlap}, layers={num_layers}")
    hidden = overlap * (num_layers - 1) / num_layers
    return max(total / num_layers, total - hidden)


# --- registry ------------------------------------------------------------------------------

# kind -> module defining `from_spec(args: list[str]) -> CostModel`; imported on first use.
COST_MODELS: dict[str, str] = {
    "roofline": "orchestrator.sim.roofline",
    "calibrated": "orchestrator.sim.calibrated",
}


def create_cost_model(spec: str) -> CostModel:
    """``roofline:MODEL:GPU[:NIC]`` (e.g. ``roofline:deepseek-r1:h200``) or
    ``calibrated:PATH`` (a JSON written by ``pdserve calibrate``)."""
    kind, _, rest = spec.partition(":")
    if kind not in COST_MODELS:
        raise ValueError(
            f"unknown cost model {kind!r} in {spec!r}; choose one of {list(COST_MODELS)}"
        )
    module = importlib.import_module(COST_MODELS[kind])
    model: CostModel = module.from_spec(rest.split(":") if rest else [])
    return model
