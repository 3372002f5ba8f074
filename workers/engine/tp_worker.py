"""Follower rank of a tensor-parallel group: a process that runs its model shard, nothing else.

Started by the leader (`workers.engine.parallel_runner`) with the ``spawn`` context and one
argument, a JSON `FollowerSpec` (no pickled objects of ours cross the process boundary). It

1. connects to the leader's TCP store, loads its slices of the checkpoint and maps its KV pool
   file (CUDA: allocates its pool with cuMem and sends the handle to the leader's socket,
   `workers.engine.shared_kv_cuda`), then publishes ``ready/<rank>`` (or ``error/<rank>``
   with the reason) in the store;
2. joins the gloo group and loops: receive a step's inputs (`TPGroup.recv_step`), run the
   forward pass over its shard (the all-reduces pair with the other ranks'), or the MTP
   module's layer over its shard (with the hidden states the leader sends), repeat;
3. exits 0 on the leader's ``SHUTDOWN``, non-zero when a collective fails (leader gone).

It never samples, schedules or computes logits; the scheduler state lives only on the leader.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from workers.engine.attention import create_attention_backend
from workers.engine.attention.base import AttentionBackend
from workers.engine.loader import load_model
from workers.engine.model import CausalLM
from workers.engine.model_config import ModelConfig
from workers.engine.mtp_drafter import MTPDrafter
from workers.engine.parallel import TPGroup, shard_spec
from workers.engine.shared_kv import dtype_from_name, map_pool
from workers.log import configure_logging

logger = logging.getLogger(__name__)

STORE_HOST = "127.0.0.1"
STARTUP_TIMEOUT = timedelta(seconds=300)


def ready_key(rank: int) -> str:
    return f"ready/{rank}"


def error_key(rank: int) -> str:
    return f"error/{rank}"


@dataclass(frozen=True)
class FollowerSpec:
    """Everything a follower needs, as plain values (crosses the spawn boundary as JSON)."""

    model_dir: str
    dtype: str  # EngineConfig.dtype
    attention_backend: str
    page_size: int
    tp_size: int
    rank: int
    store_port: int
    pool_path: str  # CPU: the pool file the leader created
    pool_shape: tuple[int, ...]
    pool_dtype: str
    num_threads: int
    device: str = "cpu"  # this rank's device (`workers.engine.parallel.rank_devices`)
    reduce_backend: str = "gloo"
    pool_socket: str = ""  # CUDA: where the leader waits for this rank's pool handle

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> FollowerSpec:
        raw = json.loads(text)
        raw["pool_shape"] = tuple(raw["pool_shape"])
        return cls(**raw)


def load_shard(
    model_dir: str, dtype: str, tp_size: int, rank: int, group: TPGroup
) -> tuple[CausalLM, ModelConfig]:
    """Rank ``rank``'s model on ``group.device``: local shapes, its checkpoint slices,
    ``group``'s all-reduce."""
    config = ModelConfig.from_dir(model_dir)
    spec = shard_spec(config, tp_size, rank)
    return load_model(model_dir, dtype, shard=spec, reduce=group.all_reduce, device=group.device)


def follower_main(spec_json: str) -> None:
    """Entry point of a spawned follower process."""
    # Ctrl-C reaches the whole process group; only the leader decides when followers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging()  # its pid tells the followers apart
    spec = FollowerSpec.from_json(spec_json)
    torch.set_num_threads(spec.num_threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore(STORE_HOST, spec.store_port, is_master=False, timeout=STARTUP_TIMEOUT)
    group = TPGroup(
        store, spec.rank, spec.tp_size, device=device, reduce_backend=spec.reduce_backend
    )
    try:
        model, backend, mtp = _build(spec, group)
    except BaseException as exc:
        store.set(error_key(spec.rank), f"{type(exc).__name__}: {exc}")
        raise
    store.set(ready_key(spec.rank), "1")
    group.connect()
    try:
        _serve(group, model, backend, mtp)
    except RuntimeError as exc:
        # Gloo reports a vanished leader (or peer) as a closed connection: nothing to save.
        logger.error("TP rank %d: lost the group, exiting: %s", spec.rank, exc)
        sys.exit(1)
    logger.info("TP rank %d: shut down by the leader", spec.rank)


def _build(
    spec: FollowerSpec, group: TPGroup
) -> tuple[CausalLM, AttentionBackend, MTPDrafter | None]:
    model, config = load_shard(spec.model_dir, spec.dtype, spec.tp_size, spec.rank, group)
    dtype = dtype_from_name(spec.pool_dtype)
    if group.device.type == "cuda":
        from workers.engine.shared_kv_cuda import create_cuda_pool_handle, offer_pool

        # Mapped until this process exits (the leader maps the same memory for its NIC).
        pool, handle = create_cuda_pool_handle(spec.pool_shape, dtype, group.device)
        offer_pool(spec.pool_socket, handle)
        kv_cache = pool.tensor
    else:
        kv_cache = map_pool(Path(spec.pool_path), spec.pool_shape, dtype)
    backend = create_attention_backend(
        spec.attention_backend, kv_cache, spec.page_size, scale=config.attention_scale
    )
    # A pool with a layer past the model's holds the MTP module's KV: the leader drafts with
    # it (or computes it for decoders), and this rank runs its shard of the module's layer.
    mtp = (
        MTPDrafter(model, kv_cache, spec.page_size, config.attention_scale, spec.attention_backend)
        if kv_cache.shape[0] > config.num_layers
        else None
    )
    return model, backend, mtp


@torch.inference_mode()
def _serve(
    group: TPGroup, model: CausalLM, backend: AttentionBackend, mtp: MTPDrafter | None
) -> None:
    while (step := group.recv_step()) is not None:
        if step.mtp:
            if mtp is None:
                raise RuntimeError("the leader sent an MTP step to a rank without the MTP layer")
            num_tokens = step.input_ids.numel()
            hidden = group.recv_hidden(num_tokens, model.config.hidden_size, model.dtype)
            mtp.forward(step.input_ids, step.positions, step.batch, hidden)
        else:
            model(step.input_ids, step.positions, step.batch, backend)
