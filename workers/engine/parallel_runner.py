"""Leader side of a tensor-parallel group: start the followers, run steps, stop them.

``start_tensor_parallel`` (called by `EngineCore` when ``tensor_parallel_size > 1``):

1. checks that the model splits over ``tp`` ranks (`TensorParallelConfigError`, before any
   process exists) and sizes the per-rank KV pool (``kv_memory_bytes`` is a per-rank budget);
2. opens a TCP store on 127.0.0.1 (the OS picks a free port), creates one pool file per
   follower in ``/dev/shm`` (CUDA: one socket per follower for its pool handle,
   `workers.engine.shared_kv_cuda.PoolExchange`) and spawns the followers
   (`workers.engine.tp_worker`), each on its device (`workers.engine.parallel.rank_devices`);
3. loads rank 0's shard and allocates rank 0's pool while the followers load theirs;
4. waits until every follower is ready (a follower that fails or dies makes it raise
   `TensorParallelError` with the reason), maps their pools (CUDA: imports their handles),
   unlinks the pool files and joins the group.

`ParallelModelRunner` is the ordinary `ModelRunner` plus the step broadcast: the leader sends
each step's inputs before its own forward pass, and the all-reduces inside the model keep the
ranks in lock step. Any failure during a step leaves the ranks out of step, so the group is
marked broken and every later step raises `TensorParallelError`.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
import weakref
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from workers.engine.attention.base import AttentionBackend, AttentionBatch
from workers.engine.config import DEFAULT_KV_MEMORY_BYTES, EngineConfig
from workers.engine.errors import TensorParallelError
from workers.engine.kv_cache import KVCacheShape, allocate_kv_cache, num_pages_for_budget
from workers.engine.layer_progress import LayerProgress
from workers.engine.loader import resolve_dtype
from workers.engine.model import CausalLM
from workers.engine.model_config import ModelConfig
from workers.engine.model_runner import ModelRunner
from workers.engine.parallel import ShardSpec, TPGroup, rank_devices, shard_spec
from workers.engine.scheduler import SchedulerOutput
from workers.engine.shared_kv import (
    create_pool_file,
    dtype_name,
    map_pool,
    new_group_name,
    pool_nbytes,
    pool_path,
    remove_stale_pool_files,
    unlink_pool_files,
)
from workers.engine.tp_worker import (
    STARTUP_TIMEOUT,
    STORE_HOST,
    FollowerSpec,
    error_key,
    follower_main,
    load_shard,
    ready_key,
)

logger = logging.getLogger(__name__)

# How long close() lets followers exit on their own after SHUTDOWN before terminating them.
SHUTDOWN_GRACE_S = 10.0


class TensorParallelRuntime:
    """The leader's handle on its group: rank 0's shard and pool, every rank's pool, the
    follower processes. ``rank_kv_caches[r]`` is rank ``r``'s pool (``[0]`` is the leader's)."""

    def __init__(
        self,
        spec: ShardSpec,
        group: TPGroup,
        model: CausalLM,
        rank_kv_caches: list[torch.Tensor],
        processes: list[BaseProcess],
        store: dist.TCPStore,
        cuda_pools: list[Any] | None = None,
    ) -> None:
        self.spec = spec
        self.group = group
        self.model = model
        self.rank_kv_caches = rank_kv_caches
        self.processes = processes
        # CUDA: the followers' pools mapped here (`CudaPool`), unmapped once they are stopped.
        self._cuda_pools = cuda_pools or []
        self._store = store  # followers keep a connection to it for their whole life
        self._failure: str | None = None
        self._closed = False
        self._reaper = weakref.finalize(self, _reap, processes, 0.0)

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.rank_kv_caches[0]

    @property
    def num_pages(self) -> int:
        return int(self.kv_cache.shape[1])

    def check_healthy(self) -> None:
        if self._closed:
            raise TensorParallelError("the tensor-parallel group is closed")
        if self._failure is None:
            dead = _dead_followers(self.processes)
            if dead:
                self._failure = f"tensor-parallel follower died: {dead}"
        if self._failure is not None:
            raise TensorParallelError(self._failure)

    def fail(self, exc: BaseException) -> TensorParallelError:
        """Mark the group broken after ``exc`` interrupted a step; the error to raise."""
        # A peer whose socket just closed is usually a process about to be reaped: give it a
        # moment so the message can name the rank and its exit code.
        deadline = time.monotonic() + 1.0
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        dead = _dead_followers(self.processes) or "no follower has exited"
        self._failure = f"tensor-parallel step failed ({type(exc).__name__}: {exc}); {dead}"
        return TensorParallelError(self._failure)

    def close(self) -> None:
        """Stop the followers (SHUTDOWN, then terminate stragglers); idempotent."""
        if self._closed:
            return
        self._closed = True
        grace_s = 0.0  # a broken group's followers may be stuck in a collective: no waiting
        try:
            if self._failure is None and not _dead_followers(self.processes):
                self.group.send_shutdown()
                grace_s = SHUTDOWN_GRACE_S
        except RuntimeError:
            logger.warning("could not send SHUTDOWN to the TP followers", exc_info=True)
        finally:
            self.group.close()
            self._reaper.detach()
            _reap(self.processes, grace_s)
            for pool in self._cuda_pools:
                pool.close()


class ParallelModelRunner(ModelRunner):
    """`ModelRunner` of the leader: broadcasts each step to the followers before running it."""

    def __init__(
        self,
        runtime: TensorParallelRuntime,
        backend: AttentionBackend,
        page_size: int,
        layer_progress: LayerProgress,
        device: torch.device,
    ) -> None:
        super().__init__(runtime.model, backend, page_size, layer_progress, device)
        self.runtime = runtime

    def run(self, step: SchedulerOutput) -> torch.Tensor | None:
        self.runtime.check_healthy()
        try:
            return super().run(step)
        except Exception as exc:
            raise self.runtime.fail(exc) from exc
        except BaseException as exc:  # KeyboardInterrupt mid-step: ranks are out of step too
            self.runtime.fail(exc)
            raise

    def prepare(self, step: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        input_ids, positions, batch = super().prepare(step)
        self.runtime.group.send_step(input_ids, positions, batch)
        return input_ids, positions, batch


def start_tensor_parallel(
    model_dir: str | Path,
    config: EngineConfig,
    model_config: ModelConfig,
    device: torch.device | None = None,
) -> TensorParallelRuntime:
    """Launch the group of ``config.tensor_parallel_size`` ranks; this process is rank 0, on
    ``device`` (default cpu).

    Followers are ``spawn``ed: a script that builds an engine must guard its entry point with
    ``if __name__ == "__main__":`` (the child re-imports the main module).
    """
    tp = config.tensor_parallel_size
    spec = shard_spec(model_config, tp, 0)  # raises before anything is started
    local_config = spec.local_config(model_config)
    dtype = resolve_dtype(config.dtype, model_config)
    num_pages = config.num_pages or num_pages_for_budget(
        local_config,
        config.page_size,
        dtype,
        config.kv_memory_bytes or DEFAULT_KV_MEMORY_BYTES,
        config.mtp_layers,
    )
    shape = KVCacheShape(
        local_config.num_layers + config.mtp_layers,
        num_pages,
        local_config.num_kv_heads,
        config.page_size,
        local_config.head_dim,
        local_config.kv_planes,
    ).as_tuple()
    device = device or torch.device("cpu")
    on_cuda = device.type == "cuda"
    devices, reduce_backend = rank_devices(device, tp, torch.cuda.device_count() if on_cuda else 1)
    if on_cuda and reduce_backend == "gloo":
        logger.warning(
            "%d TP ranks share %d GPU(s): all-reduce over gloo through the host (slow)",
            tp,
            torch.cuda.device_count(),
        )
    group_name = new_group_name()
    paths = [] if on_cuda else [pool_path(group_name, rank) for rank in range(1, tp)]
    if paths:
        remove_stale_pool_files()
    exchange: Any = None
    cuda_pools: list[Any] = []
    store = dist.TCPStore(STORE_HOST, 0, is_master=True, timeout=STARTUP_TIMEOUT)
    processes: list[BaseProcess] = []
    try:
        for path in paths:
            create_pool_file(path, pool_nbytes(shape, dtype))
        if on_cuda:
            from workers.engine.shared_kv_cuda import PoolExchange

            exchange = PoolExchange(range(1, tp))
        for rank in range(1, tp):
            follower = FollowerSpec(
                model_dir=str(model_dir),
                dtype=config.dtype,
                attention_backend=config.attention_backend,
                page_size=config.page_size,
                tp_size=tp,
                rank=rank,
                store_port=store.port,
                pool_path="" if on_cuda else str(paths[rank - 1]),
                pool_shape=shape,
                pool_dtype=dtype_name(dtype),
                num_threads=follower_num_threads(tp),
                device=str(devices[rank]),
                reduce_backend=reduce_backend,
                pool_socket=exchange.path(rank) if on_cuda else "",
            )
            processes.append(_spawn(follower))
        group = TPGroup(store, 0, tp, device=device, reduce_backend=reduce_backend)
        model, _ = load_shard(str(model_dir), config.dtype, tp, 0, group)
        kv_cache = allocate_kv_cache(
            local_config, num_pages, config.page_size, dtype, device, config.mtp_layers
        )
        _wait_ready(store, processes)
        if on_cuda:
            cuda_pools = _import_pools(exchange, tp, shape, dtype)
            rank_kv_caches = [kv_cache, *(pool.tensor for pool in cuda_pools)]
        else:
            rank_kv_caches = [kv_cache, *(map_pool(path, shape, dtype) for path in paths)]
        group.connect()
    except BaseException:
        _reap(processes, 0.0)
        for pool in cuda_pools:
            pool.close()
        raise
    finally:
        # Every rank has mapped its file by now (or failed): the names are no longer needed.
        unlink_pool_files(paths)
        if exchange is not None:
            exchange.close()
    logger.info("tensor-parallel group of %d ranks ready (%s)", tp, group_name)
    return TensorParallelRuntime(spec, group, model, rank_kv_caches, processes, store, cuda_pools)


def _import_pools(exchange: Any, tp: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[Any]:
    """Map every follower's cuMem pool here (rank order); each sent its handle before it
    reported ready."""
    from workers.engine.shared_kv_cuda import open_cuda_pool_handle

    pools: list[Any] = []
    try:
        for rank in range(1, tp):
            handle = exchange.receive(rank, STARTUP_TIMEOUT.total_seconds())
            pools.append(open_cuda_pool_handle(handle, shape, dtype))
    except BaseException:
        for pool in pools:
            pool.close()
        raise
    return pools


def follower_num_threads(tp: int) -> int:
    """Intra-op threads of each follower: the cores split over the ranks, and never more than
    the leader's own setting (``torch.set_num_threads(1)`` in the leader keeps the group at 1)."""
    return max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // tp))


def _spawn(follower: FollowerSpec) -> BaseProcess:
    context = mp.get_context("spawn")
    process = context.Process(
        target=follower_main, args=(follower.to_json(),), name=f"pdserve-tp{follower.rank}"
    )
    process.daemon = True  # never outlive the leader
    process.start()
    return process


def _wait_ready(store: dist.TCPStore, processes: list[BaseProcess]) -> None:
    pending = dict(enumerate(processes, start=1))
    deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
    while pending:
        for rank, process in list(pending.items()):
            if store.check([ready_key(rank)]):
                del pending[rank]
            elif store.check([error_key(rank)]):
                reason = store.get(error_key(rank)).decode(errors="replace")
                raise TensorParallelError(f"TP rank {rank} failed to start: {reason}")
            elif not process.is_alive() and not store.check([error_key(rank)]):
                raise TensorParallelError(
                    f"TP rank {rank} (pid {process.pid}) exited with code {process.exitcode} "
                    "before it was ready"
                )
        if pending and time.monotonic() > deadline:
            raise TensorParallelError(f"TP ranks {sorted(pending)} not ready in time")
        time.sleep(0.01)


def _dead_followers(processes: list[BaseProcess]) -> str:
    return ", ".join(
        f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
        for rank, p in enumerate(processes, start=1)
        if not p.is_alive()
    )


def _reap(processes: list[BaseProcess], grace_s: float) -> None:
    """Wait up to ``grace_s`` for the followers to exit, then terminate, then kill."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            logger.warning("terminating TP follower %s (pid %s)", process.name, process.pid)
            process.terminate()
            process.join(timeout=5.0)
        if process.is_alive():
            process.kill()
            process.join()
