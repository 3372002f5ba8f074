"""Mixture-of-experts MLP: a router picks ``top_k`` of ``num_experts`` SwiGLU experts per token
(DeepSeek-V2 / V3, Qwen3-MoE), plus DeepSeek's shared experts that every token runs.

Routing follows transformers' modelling code operation for operation, in float32 (the router
weight is kept in float32 whatever the model dtype, as HF keeps DeepSeek's), so the same
experts are chosen; `MoEConfig` documents the scoring and top-k methods.

Tensor parallelism: the routed experts are split over the ranks (rank ``r`` holds experts
``[r * E/tp, (r+1) * E/tp)``), the shared experts are one dense MLP split by columns like any
other; every rank routes every token (the router is replicated), runs the tokens its own experts
were picked for, and one all-reduce sums the routed and shared partial outputs. Expert
parallelism across groups is out of scope.

CPU execution: tokens are sorted by expert once per layer and each expert with work runs two
GEMMs over its tokens (its gate|up rows fused, then down), scaled by the routing weights and
added back with ``index_add_``: work proportional to ``tokens * top_k``, no padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.engine.cpu_gemm import linear
from workers.engine.model_config import MoEConfig
from workers.engine.rms_norm import Reduce, empty_parameter


class Router(nn.Module):
    """Expert choice per token: (weights [T, top_k] float32, expert ids [T, top_k])."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = empty_parameter(moe.num_experts, hidden_size, dtype=torch.float32)
        # noaux_tc's load-balancing bias: steers the choice, not the weights.
        self.e_score_correction_bias = (
            empty_parameter(moe.num_experts, dtype=torch.float32)
            if moe.topk_method == "noaux_tc"
            else None
        )

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.moe
        logits = linear(hidden.to(torch.float32), self.weight)
        if moe.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=-1, dtype=torch.float32)
        if moe.topk_method == "greedy":
            weights, ids = torch.topk(scores, k=moe.top_k, dim=-1, sorted=False)
        else:
            choice = scores
            if self.e_score_correction_bias is not None:
                choice = scores + self.e_score_correction_bias
            grouped = choice.view(-1, moe.n_group, moe.num_experts // moe.n_group)
            if moe.topk_method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            else:
                group_scores = grouped.max(dim=-1).values
            group_ids = torch.topk(group_scores, k=moe.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1.0).bool()
            expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape_as(choice)
            # Experts of the other groups can never be chosen: -inf for the biased choice,
            # 0 for plain probabilities (HF's two variants, same choice either way).
            fill = float("-inf") if moe.topk_method == "noaux_tc" else 0.0
            choice = choice.masked_fill(~expert_mask, fill)
            ids = torch.topk(choice, k=moe.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if moe.routed_scaling_factor != 1.0:
            weights = weights * moe.routed_scaling_factor
        return weights, ids


class MoE(nn.Module):
    """Routed experts (this rank's share) plus the shared experts, if any."""

    def __init__(
        self,
        hidden_size: int,
        moe: MoEConfig,
        dtype: torch.dtype,
        reduce: Reduce | None = None,
        tp_size: int = 1,
        tp_rank: int = 0,
    ) -> None:
        super().__init__()
        self.moe = moe
        self.reduce = reduce
        self.gate = Router(hidden_size, moe)
        self.num_local_experts = moe.num_experts // tp_size
        self.expert_start = tp_rank * self.num_local_experts
        inter = moe.intermediate_size
        # Per expert: gate rows then up rows ([E_local, 2I, H]), and down ([E_local, H, I]).
        self.experts_gate_up = empty_parameter(
            self.num_local_experts, 2 * inter, hidden_size, dtype=dtype
        )
        self.experts_down = empty_parameter(self.num_local_experts, hidden_size, inter, dtype=dtype)
        shared = moe.num_shared_experts * inter // tp_size
        self.shared_intermediate_size = shared
        self.shared_gate_up = (
            empty_parameter(2 * shared, hidden_size, dtype=dtype) if shared else None
        )
        self.shared_down = empty_parameter(hidden_size, shared, dtype=dtype) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.routed(x, weights, ids)
        if self.shared_gate_up is not None and self.shared_down is not None:
            gate, up = linear(x, self.shared_gate_up).split(self.shared_intermediate_size, -1)
            out += linear(F.silu(gate).mul_(up), self.shared_down)
        if self.reduce is not None:
            self.reduce(out)
        return out

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Sum over the chosen experts held here of weight * expert(x), per token."""
        top_k = ids.shape[1]
        flat = ids.reshape(-1)
        # Token slots sorted by expert (stable: a token's slots stay in token order).
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()
        tokens = order // top_k
        slot_weights = weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        inter = self.moe.intermediate_size
        begin = sum(counts[: self.expert_start])
        for local in range(self.num_local_experts):
            count = counts[self.expert_start + local]
            if count == 0:
                continue
            rows = tokens[begin : begin + count]
            gate, up = F.linear(x[rows], self.experts_gate_up[local]).split(inter, dim=-1)
            y = F.linear(F.silu(gate) * up, self.experts_down[local])
            y = y * slot_weights[begin : begin + count, None].to(y.dtype)
            out.index_add_(0, rows, y)
            begin += count
        return out
