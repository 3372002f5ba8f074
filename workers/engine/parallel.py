"""Tensor parallelism: how one model is split over ``tp`` ranks, and how the ranks talk.

Sharding (Megatron-style, vLLM's head placement; see `workers.engine.head_placement`):

- q/k/v and gate/up are column-parallel: rank ``r`` computes query heads
  ``[r * Hq/tp, (r+1) * Hq/tp)``, the KV heads `GroupSharding` assigns it (a range of ``H/tp``
  heads, or, when ``tp > H``, the single head ``r // (tp/H)`` shared by ``tp/H`` consecutive
  ranks), and MLP columns ``[r * I/tp, (r+1) * I/tp)``. Query head ``j`` reads KV head
  ``j // (Hq/H)``, so each rank's query heads only ever read its own KV heads.
- o_proj and down_proj are row-parallel: each rank multiplies its slice and the partial outputs
  are summed with an all-reduce, after which every rank holds the identical full hidden state.
- Embedding, norms and LM head are replicated; only the leader computes logits.
- MLA (DeepSeek): query heads, ``kv_b_proj`` rows and ``o_proj`` columns are split by head;
  the latent projection is replicated, so every rank caches the identical latent (one "KV head"
  on every rank, `GroupSharding.is_mla`).
- MoE: routed experts are split over the ranks, the shared experts by columns like any MLP
  (`workers.engine.moe`).

Each rank runs a `CausalLM` built from `ShardSpec.local_config` (the model with local head and
MLP counts), so the model code is the single-device code plus the all-reduce hook.

Wire (leader rank 0 -> followers, gloo broadcast, no pickle): every step is a fixed-size int64
header ``[opcode, num_tokens, num_seqs, max_pages, payload_len, 0, 0, 0]`` followed, for
``STEP``, by one flat int64 payload: input_ids[T] | positions[T] | query_start_loc[B+1] |
seq_lens[B] | context_lens[B] | page_table[B*max_pages] | slot_mapping[T]. ``SHUTDOWN`` has no
payload. Followers wait for a header with a very long timeout (an idle engine is normal); every
other collective uses the group's timeout, so a dead or stuck rank surfaces as an error.

The step broadcast always runs on gloo (its tensors are host-side ints). The model's all-reduce
runs on that gloo group on CPU; on CUDA (`rank_devices`) on an NCCL group over the same store
when every rank has a GPU of its own, else on gloo, which reduces CUDA tensors through the host
(ranks sharing one GPU, which NCCL refuses: tests on a one-GPU machine). Followers move each
received step to their device.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from workers.engine.attention.base import AttentionBatch
from workers.engine.errors import HeadPlacementError, TensorParallelConfigError
from workers.engine.head_placement import GroupSharding
from workers.engine.model_config import ModelConfig

logger = logging.getLogger(__name__)

# Collectives inside a step: a healthy peer answers in milliseconds, a dead one usually closes
# its socket at once; the timeout only catches a peer that hangs.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)
# Followers waiting for the next step: the leader may legitimately idle for a long time.
IDLE_TIMEOUT = timedelta(days=365)

OP_STEP = 1
OP_SHUTDOWN = 2
OP_MTP = 3  # the MTP module's layer over a step (`workers.engine.mtp_drafter`)
HEADER_LEN = 8


@dataclass(frozen=True)
class ShardSpec:
    """Which slice of every sharded weight one rank holds (global indices)."""

    tp_size: int
    rank: int
    q_head_start: int
    num_q_heads: int
    kv_head_start: int
    num_kv_heads: int
    mlp_start: int
    mlp_size: int
    total_kv_heads: int
    is_mla: bool = False

    @property
    def kv_sharding(self) -> GroupSharding:
        """The placement rule shared with the KV messenger's transfer plans."""
        return GroupSharding(self.tp_size, self.total_kv_heads, self.is_mla)

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """``config`` with this rank's head and MLP counts: the shape of the rank's model."""
        return dataclasses.replace(
            config,
            num_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.mlp_size,
        )


def check_tensor_parallel(config: ModelConfig, tp_size: int) -> GroupSharding:
    """Raise `TensorParallelConfigError` unless ``config`` splits over ``tp_size`` ranks."""
    if tp_size < 1:
        raise TensorParallelConfigError(f"tensor_parallel_size must be >= 1, got {tp_size}")
    problems = []
    if config.num_heads % tp_size:
        problems.append(f"{config.num_heads} attention heads are not divisible by {tp_size}")
    if config.intermediate_size % tp_size:
        problems.append(
            f"intermediate size {config.intermediate_size} is not divisible by {tp_size}"
        )
    moe = config.moe
    if moe is not None and moe.num_experts % tp_size:
        problems.append(f"{moe.num_experts} routed experts are not divisible by {tp_size}")
    if moe is not None and (moe.num_shared_experts * moe.intermediate_size) % tp_size:
        problems.append(
            f"shared experts' intermediate size {moe.num_shared_experts * moe.intermediate_size}"
            f" is not divisible by {tp_size}"
        )
    try:
        sharding = GroupSharding(tp_size, config.num_kv_heads, config.is_mla)
    except HeadPlacementError as exc:
        problems.append(str(exc))
    if problems:
        raise TensorParallelConfigError(
            f"tensor_parallel_size={tp_size} does not fit this model: " + "; ".join(problems)
        )
    return sharding


def shard_spec(config: ModelConfig, tp_size: int, rank: int) -> ShardSpec:
    sharding = check_tensor_parallel(config, tp_size)
    num_q = config.num_heads // tp_size
    mlp = config.intermediate_size // tp_size
    return ShardSpec(
        tp_size=tp_size,
        rank=rank,
        q_head_start=rank * num_q,
        num_q_heads=num_q,
        kv_head_start=sharding.head_start(rank),
        num_kv_heads=sharding.heads_per_rank,
        mlp_start=rank * mlp,
        mlp_size=mlp,
        total_kv_heads=config.num_kv_heads,
        is_mla=config.is_mla,
    )


def rank_devices(
    leader: torch.device, tp_size: int, device_count: int
) -> tuple[list[torch.device], str]:
    """Every rank's device (index = rank) and the all-reduce backend (``gloo`` or ``nccl``).

    CPU: all on the CPU, gloo. CUDA: rank ``r`` on the ``r``-th device after the leader's
    (wrapping around); NCCL when that gives every rank its own GPU, else gloo.
    """
    if leader.type != "cuda":
        return [torch.device("cpu")] * tp_size, "gloo"
    first = leader.index or 0
    devices = [torch.device("cuda", (first + rank) % device_count) for rank in range(tp_size)]
    return devices, "nccl" if device_count >= tp_size else "gloo"


class TPGroup:
    """One rank's end of the group: the all-reduce of the model and the step broadcast.

    Built unconnected so the model can take `all_reduce` as its hook before the ranks meet;
    `connect` then rendezvouses through ``store`` (every rank must call it). ``device``: where
    this rank computes (received steps are moved there); ``reduce_backend``: `rank_devices`.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: timedelta = COLLECTIVE_TIMEOUT,
        *,
        device: torch.device | None = None,
        reduce_backend: str = "gloo",
    ) -> None:
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.device = device or torch.device("cpu")
        self.reduce_backend = reduce_backend
        self._store = store
        # Any: torch's stubs declare the collectives on ProcessGroup only, not on the backends.
        self._pg: Any = None
        self._reduce_pg: Any = None

    def connect(self) -> None:
        self._pg = dist.ProcessGroupGloo(
            dist.PrefixStore("tp", self._store), self.rank, self.size, self.timeout
        )
        self._reduce_pg = self._pg
        if self.reduce_backend == "nccl":
            nccl: Any = getattr(dist, "ProcessGroupNCCL", None)
            if nccl is None:
                raise RuntimeError("tensor parallelism on CUDA needs a torch built with NCCL")
            # On an NCCL error or timeout (a rank died mid-step) abort the communicator and
            # raise in this process (2: CleanUpOnly), rather than torch's default of killing
            # it (3), which would end the worker without failing its requests. Read when the
            # group is created; a value the user set is kept.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
            options = nccl.Options()
            options._timeout = self.timeout
            store = dist.PrefixStore("tp-nccl", self._store)
            self._reduce_pg = nccl(store, self.rank, self.size, options)

    def close(self) -> None:
        """Drop the connections (peers blocked on this rank see them close)."""
        self._pg = self._reduce_pg = None

    @property
    def pg(self) -> Any:
        if self._pg is None:
            raise RuntimeError("the tensor-parallel group is not connected")
        return self._pg

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over all ranks, in place (the row-parallel projections' outputs)."""
        if self._reduce_pg is None:
            raise RuntimeError("the tensor-parallel group is not connected")
        self._reduce_pg.allreduce([tensor]).wait()

    def _broadcast(self, tensor: torch.Tensor, timeout: timedelta | None = None) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        options.timeout = timeout or self.timeout
        self.pg.broadcast([tensor], options).wait()

    # --- leader side ------------------------------------------------------------------------

    def send_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        opcode: int = OP_STEP,
    ) -> None:
        fields = [
            input_ids,
            positions,
            batch.query_start_loc,
            batch.seq_lens,
            batch.context_lens,
            batch.page_table.reshape(-1),
            batch.slot_mapping,
            batch.num_prompt_tokens if batch.num_prompt_tokens is not None else batch.seq_lens,
        ]
        payload = torch.cat([f.to("cpu", torch.int64) for f in fields])
        num_seqs, max_pages = batch.page_table.shape
        self._broadcast(_header(opcode, input_ids.numel(), num_seqs, max_pages, payload.numel()))
        self._broadcast(payload)

    def send_mtp(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        hidden: torch.Tensor,
    ) -> None:
        """A step of the MTP module: its inputs as a model step's, then the main model's final
        hidden states it reads (the leader's: the followers' own rows were not selected)."""
        self.send_step(input_ids, positions, batch, OP_MTP)
        # float32 on the wire: exact for bfloat16 and float16 states, and any backend takes it.
        self._broadcast(hidden.to("cpu", torch.float32).contiguous())

    def send_shutdown(self) -> None:
        self._broadcast(_header(OP_SHUTDOWN, 0, 0, 0, 0))

    # --- follower side ----------------------------------------------------------------------

    def recv_step(self) -> FollowerStep | None:
        """The next step's inputs, or None when the leader shuts the group down."""
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        self._broadcast(header, IDLE_TIMEOUT)
        opcode, num_tokens, num_seqs, max_pages, payload_len = header[:5].tolist()
        if opcode == OP_SHUTDOWN:
            return None
        if opcode not in (OP_STEP, OP_MTP):
            raise RuntimeError(f"unknown TP opcode {opcode} in header {header.tolist()}")
        payload = torch.empty(payload_len, dtype=torch.int64)
        self._broadcast(payload)
        sizes = [num_tokens, num_tokens, num_seqs + 1, num_seqs, num_seqs]
        sizes += [num_seqs * max_pages, num_tokens, num_seqs]
        if sum(sizes) != payload_len:
            raise RuntimeError(f"TP header {header.tolist()} does not match its payload")
        fields = payload.split(sizes)
        query_lens, seq_lens_list = torch.diff(fields[2]).tolist(), fields[3].tolist()
        ids, pos, starts, seq_lens, context_lens, table, slots, num_prompt_tokens = (
            field.to(self.device) for field in fields
        )
        batch = AttentionBatch(
            query_start_loc=starts,
            seq_lens=seq_lens,
            context_lens=context_lens,
            page_table=table.reshape(num_seqs, max_pages),
            slot_mapping=slots,
            query_lens_list=tuple(query_lens),
            seq_lens_list=tuple(seq_lens_list),
            num_prompt_tokens=num_prompt_tokens,
        )
        return FollowerStep(opcode == OP_MTP, ids, pos, batch)

    def recv_hidden(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        """After an MTP step's inputs: the hidden states it reads, on this rank's device."""
        hidden = torch.empty(num_tokens, hidden_size, dtype=torch.float32)
        self._broadcast(hidden)
        return hidden.to(self.device, dtype)


class FollowerStep(NamedTuple):
    """A step a follower received: the model's (``mtp`` False) or the MTP module's."""

    mtp: bool
    input_ids: torch.Tensor
    positions: torch.Tensor
    batch: AttentionBatch


def _header(*values: int) -> torch.Tensor:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[: len(values)] = torch.tensor(values, dtype=torch.int64)
    return header
