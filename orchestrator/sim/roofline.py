"""Roofline cost model: each kind of kernel of a step costs max(FLOPs / achieved FLOP/s,
bytes / achieved bandwidth) per rank; a step is the sum of its kernels (linear layers,
attention), tensor-parallel all-reduces and a fixed per-step overhead.

Per rank of a TP group of ``tp`` GPUs: FLOPs are 2 x active parameters per token plus
attention; bytes are the weights the step touches (dense weights always, routed experts in
proportion to the experts the step's tokens select) plus the KV the decode sequences read.
Weights and attention heads split evenly over ranks; the KV splits with the KV heads (GQA) or
is replicated on every rank (MLA, or GQA with more ranks than KV heads).

Speculative decoding: a sequence's drafts are more rows of the same pass (more tokens through
the linear layers, hence more experts touched) whose attention reads the context its newest
token reads, once: they add attention FLOPs, not KV bytes. The MTP module's passes
(`StepShape.num_mtp_passes`) are priced as one more layer each, run after the step: the
module's dense part, projection and head plus the routed experts its positions select, one
layer's share of the step's attention and two all-reduces.

Expert parallelism across instances (``expert_domain`` > 1, `spread_experts`): a domain of
``expert_domain`` instances keeps one copy of the routed experts, spread over all its GPUs,
while each instance attends to its own sequences (data-parallel attention, the wide-EP
deployments of DeepSeek's decoders). A step then reads the experts that the whole domain's
tokens select, divided over the domain's GPUs, and sends each token to its experts' GPUs and
back (dispatch and combine, two all-to-alls per MoE layer) over the nodes' NICs. The
members are assumed to carry equal loads (the router balances them): the domain's step
routes ``expert_domain`` times this instance's tokens. Not modelled: the lockstep wait for
the slowest member, and overlapping the all-to-alls with compute (two micro-batches), which
real deployments use to hide them: the price is conservative there.

Achieved rates are explicit parameters (`Efficiency`), not hidden in the presets: the model
is only as good as they are, and a calibrated model should replace it when one exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

from orchestrator.sim.cost import StepShape
from orchestrator.sim.hardware import GPUS, NICS, GPUSpec, NICSpec
from orchestrator.sim.models import MODELS, ModelSpec
from orchestrator.sim.noise import Spread
from orchestrator.sim.shared_cores import SharedCores


@dataclass(frozen=True)
class Efficiency:
    """Fractions of datasheet peaks that real kernels reach. Defaults are round figures of
    the kind serving papers report (GEMM-heavy prefill at ~50% MFU, decode at ~70% of HBM
    bandwidth), chosen before comparing with any target; override them when you know better.

    step_overhead_s: scheduler, sampling and launch cost of every step (CUDA graphs assumed).
    allreduce_latency_s: fixed cost of one small all-reduce over NVLink.
    memory_utilization: share of HBM the engine may use (weights + KV + activations).
    """

    mfu: float = 0.5
    bandwidth: float = 0.7
    nic: float = 0.8
    step_overhead_s: float = 1e-3
    allreduce_latency_s: float = 10e-6
    memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        for name in ("mfu", "bandwidth", "nic", "memory_utilization"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"efficiency {name} must be in (0, 1], got {value}")
        if self.step_overhead_s < 0 or self.allreduce_latency_s < 0:
            raise ValueError("overheads must be >= 0")


@dataclass(frozen=True)
class RooflineCostModel:
    model: ModelSpec
    gpu: GPUSpec
    nic: NICSpec
    efficiency: Efficiency = field(default_factory=Efficiency)
    expert_domain: int = 1  # instances one copy of the routed experts is spread over

    def __post_init__(self) -> None:
        if self.expert_domain < 1:
            raise ValueError(f"expert_domain must be >= 1, got {self.expert_domain}")
        if self.expert_domain > 1 and not self.model.num_experts:
            raise ValueError(f"{self.model.name} has no routed experts to spread over instances")

    @property
    def name(self) -> str:
        name = f"roofline {self.model.name} on {self.gpu.name}, {self.nic.name}"
        if self.expert_domain > 1:
            name += f", experts over {self.expert_domain} instances"
        return name

    @property
    def num_layers(self) -> int:
        return self.model.num_layers

    def with_efficiency(self, **changes: float) -> RooflineCostModel:
        return replace(self, efficiency=replace(self.efficiency, **changes))

    def spread_experts(self, instances: int) -> RooflineCostModel:
        """This model for an instance of an expert-parallel domain of ``instances``."""
        return replace(self, expert_domain=instances)

    # --- the CostModel protocol -----------------------------------------------------------

    def step_seconds(
        self,
        shape: StepShape,
        tp: int,
        busy_others: Sequence[str] = (),
        role: str | None = None,
    ) -> float:
        # Each instance has GPUs of its own: what the other instances do costs it nothing.
        # Kernels run one after another, so each gets its own roofline and the times add:
        # the linear layers (weights read once for every token of the step) and attention
        # (prefill attention is compute-bound, decode attention streams the KV).
        m, eff = self.model, self.efficiency
        flop_rate = self.gpu.peak_flops * eff.mfu * tp
        byte_rate = self.gpu.hbm_bandwidth * eff.bandwidth
        tokens = shape.num_tokens
        weights = m.dense_params + self._routed_read(m.routed_params, tokens)
        linear = max(
            2.0 * m.active_params * tokens / flop_rate, weights * m.weight_bytes / tp / byte_rate
        )
        prefill_attention = m.num_layers * m.attn_flops_per_position * shape.num_prefill_attention
        # Decode reads every context (a sequence's drafts read it with its newest token, in
        # the same kernel); prefill and drafts write their own tokens' KV.
        written = shape.num_prefill_tokens + shape.num_draft_tokens
        kv = m.kv_bytes_per_token * (shape.num_decode_kv_tokens + written)
        decode_flops = m.decode_attn_flops_per_position or m.attn_flops_per_position
        decode_positions = shape.num_decode_kv_tokens + shape.num_draft_attention
        decode_attention = m.num_layers * decode_flops * decode_positions
        attention = max(
            (prefill_attention + decode_attention) / flop_rate, kv * self._kv_share(tp) / byte_rate
        )
        layers = m.num_layers
        mtp = self._mtp_seconds(shape, tp, attention / layers) if shape.num_mtp_passes else 0.0
        allreduce = self._allreduce_seconds(tokens, tp, layers)
        alltoall = self._alltoall_seconds(tokens, tp, m.num_moe_layers)
        return linear + attention + allreduce + alltoall + mtp + eff.step_overhead_s

    def step_noise(self) -> dict[tuple[str, str], Spread]:
        return {}  # a model of hardware, not a measurement: no spread

    def kv_bytes(self, num_tokens: int) -> int:
        return int(self.model.kv_bytes_per_token * num_tokens)

    def transfer_seconds(self, num_tokens: int, tp_prefill: int, tp_decode: int) -> float:
        # Every destination replica set receives its own copy (docs/design.md §4); distinct
        # source ranks drive distinct NICs, at most the node's NIC count.
        copies = max(1.0, tp_decode * self._kv_share(tp_decode))
        nics = min(tp_prefill, tp_decode, self.nic.num_nics)
        rate = nics * self.nic.bandwidth * self.efficiency.nic
        return self.kv_bytes(num_tokens) * copies / rate + self.nic.latency

    def request_overhead_seconds(self, disaggregated: bool) -> float:
        return 0.0  # milliseconds against the seconds of a reference deployment's TTFT

    def token_delay_seconds(self, disaggregated: bool) -> float:
        return 0.0  # a model of hardware: the serving stack's way out is not in it

    def kv_capacity_tokens(self, tp: int) -> int:
        m = self.model
        per_rank = self.gpu.hbm_bytes * self.efficiency.memory_utilization
        held = m.dense_params + m.routed_params / self.expert_domain  # this instance's share
        free = per_rank - held * m.weight_bytes / tp
        return int(free / (self.model.kv_bytes_per_token * self._kv_share(tp)))

    @property
    def shared_cores(self) -> SharedCores | None:
        return None  # each instance has GPUs of its own

    def supports_tp(self, tp: int) -> bool:
        m = self.model
        if tp < 1 or tp & (tp - 1) or tp > self.gpu.gpus_per_node or m.num_heads % tp:
            return False
        if m.attention == "gqa" and m.num_kv_heads % tp and tp % m.num_kv_heads:
            return False
        return self.kv_capacity_tokens(tp) > 0

    # --- parts ----------------------------------------------------------------------------

    def _kv_share(self, tp: int) -> float:
        """Share of one token's KV that each rank holds."""
        if self.model.attention == "mla":
            return 1.0
        return max(1.0 / tp, 1.0 / self.model.num_kv_heads)

    def _mtp_seconds(self, shape: StepShape, tp: int, layer_attention: float) -> float:
        """The MTP module's passes of a step: each one layer over its share of the positions
        (``layer_attention``: one layer's share of the step's attention time)."""
        m, eff = self.model, self.efficiency
        if not m.num_mtp_modules:
            raise ValueError(f"{m.name} has no MTP module to draft with (use n-gram drafts)")
        passes, positions = shape.num_mtp_passes, shape.num_mtp_tokens
        flop_rate = self.gpu.peak_flops * eff.mfu * tp
        byte_rate = self.gpu.hbm_bandwidth * eff.bandwidth
        # Every pass reads the module's weights again; the experts touched are those of the
        # positions of one pass (an even split of the step's positions over its passes).
        moe_layer = m.routed_params / m.num_moe_layers if m.num_moe_layers else 0.0
        per_pass = m.mtp_dense_params + self._routed_read(moe_layer, positions / passes)
        weights = passes * per_pass * m.weight_bytes
        linear = max(2.0 * m.mtp_active_params * positions / flop_rate, weights / tp / byte_rate)
        allreduce = self._allreduce_seconds(positions / passes, tp, passes)
        alltoall = self._alltoall_seconds(positions / passes, tp, passes if moe_layer else 0)
        return linear + passes * layer_attention + allreduce + alltoall

    def _routed_read(self, routed_params: float, tokens: float) -> float:
        """Parameters of ``routed_params`` (one or all MoE layers) that this instance reads in
        a step of ``tokens`` tokens: those the domain's tokens select, its share of them."""
        domain = self.expert_domain
        return routed_params * self.model.expert_fraction_read(domain * tokens) / domain

    def _alltoall_seconds(self, tokens: float, tp: int, moe_layers: int) -> float:
        """Dispatch and combine of ``moe_layers`` layers over ``tokens`` tokens, across nodes.

        Each of the instance's ``tp`` GPUs sends its share of the tokens to every expert
        they select, FP8 out (1 byte an element) and BF16 back (2), over its own NIC (at most
        the node's NIC count); the experts on the instance's own GPUs (1 / domain of them) are
        reached over NVLink, priced as free. Each all-to-all also pays one NIC latency. As
        DeepEP's low-latency kernels count bytes: per (token, expert), not per node."""
        domain = self.expert_domain
        if domain == 1 or not moe_layers:
            return 0.0
        m, nic = self.model, self.nic
        remote = (domain - 1) / domain
        elements = tokens * m.experts_per_token * m.hidden_size * remote
        rate = min(tp, nic.num_nics) * nic.bandwidth * self.efficiency.nic
        per_layer = 2 * nic.latency + elements * (1.0 + 2.0) / rate
        return moe_layers * per_layer

    def _allreduce_seconds(self, tokens: float, tp: int, layers: int) -> float:
        """``layers`` layers, each over ``tokens`` tokens."""
        if tp == 1:
            return 0.0
        # Two all-reduces per layer (attention output, MLP output) of BF16 activations; ring
        # all-reduce moves 2 (tp - 1) / tp of the buffer through each GPU's link.
        size = tokens * self.model.hidden_size * 2.0
        one = (
            self.efficiency.allreduce_latency_s
            + 2 * (tp - 1) / tp * size / self.gpu.nvlink_bandwidth
        )
        return 2 * layers * one


def from_spec(args: list[str]) -> RooflineCostModel:
    """``MODEL:GPU[:NIC][:KEY=VALUE...]``, e.g. ``deepseek-r1:h200:8x400g:mfu=0.4``."""
    names = [a for a in args if "=" not in a]
    if len(names) not in (2, 3):
        raise ValueError(f"roofline needs MODEL:GPU[:NIC], got {':'.join(args)!r}")
    model, gpu, nic = names[0], names[1], names[2] if len(names) == 3 else "8x400g"
    for key, table in ((model, MODELS), (gpu, GPUS), (nic, NICS)):
        if key not in table:
            raise ValueError(f"unknown preset {key!r}; choose one of {sorted(table)}")
    try:
        overrides = {k: float(v) for k, v in (a.split("=", 1) for a in args if "=" in a)}
        efficiency = Efficiency(**overrides)
    except TypeError:  # a key that is not a field
        known = [f.name for f in fields(Efficiency)]
        raise ValueError(
            f"unknown roofline setting in {':'.join(args)!r}; choose from {known}"
        ) from None
    return RooflineCostModel(MODELS[model], GPUS[gpu], NICS[nic], efficiency)
