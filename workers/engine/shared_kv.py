"""KV pools of tensor-parallel ranks in shared memory, mapped into the leader.

One messenger and one transfer engine serve a whole TP group from the leader (docs/design.md §4), so
the leader must be able to address every rank's KV pool. On CPU each follower's pool
``[L, N, planes, H_local, P, D]`` (planes: K and V, or MLA's one latent; the leader builds the
shape from the model, `workers.engine.kv_cache.KVCacheShape`, and hands it to every rank) is a
file in ``/dev/shm`` that the follower and the leader both map (``MAP_SHARED``): the follower's
attention writes land directly in memory the leader can register with libfabric.

Life cycle (named per group, so concurrent groups never collide):

1. the leader creates one file per follower (``O_EXCL``) and reserves its size;
2. each follower maps its file and reports ready; the leader maps every file;
3. the leader unlinks the files at once: the mappings stay valid until the last process
   unmaps, so nothing can leak in ``/dev/shm`` even if a process is killed later.
   A failed start unlinks them too; a leader killed before step 3 leaves its files, which the
   next leader on the machine removes (`remove_stale_pool_files`).

GPU (``shared_kv_cuda``; `workers.engine.parallel_runner` and `tp_worker` use it on CUDA):
each rank allocates its pool with ``cuMemCreate`` (``CU_MEM_HANDLE_TYPE_
POSIX_FILE_DESCRIPTOR``, its own device), maps it with ``cuMemMap`` / ``cuMemSetAccess`` and
wraps the address as a tensor (``__cuda_array_interface__``). It exports a file descriptor with
``cuMemExportToShareableHandle`` and passes it to the leader over a Unix socket
(``SCM_RIGHTS``; descriptors cannot travel through the TCP store). The leader imports it with
``cuMemImportFromShareableHandle``, reserves address space, maps it and grants the owning
device access to that range; its transfer engine (``hmem=True``) registers the range with
``FI_HMEM_CUDA``. The leader unmaps the pools after its followers stopped, which is after the
messenger deregistered the memory.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterable
from pathlib import Path

import torch

from workers.engine.errors import TensorParallelError

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
POOL_FILE_PREFIX = "pdserve-kv-"


def new_group_name() -> str:
    """A name unique to one TP group (pid + random), used for its pool files."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


def pool_path(group_name: str, rank: int, directory: Path = SHM_DIR) -> Path:
    return directory / f"{POOL_FILE_PREFIX}{group_name}-rank{rank}"


def pool_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel * torch.empty((), dtype=dtype).element_size()


def create_pool_file(path: Path, nbytes: int) -> None:
    """Create ``path`` (it must not exist) holding ``nbytes`` of zeros.

    The space is reserved now (``posix_fallocate``): a sparse file on a too-small tmpfs (64 MiB
    is a common container default) would instead kill a rank with SIGBUS on its first write.
    """
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        os.close(fd)
        path.unlink()
        raise TensorParallelError(
            f"cannot reserve a {nbytes / 2**20:.1f} MiB KV pool in {path.parent} ({exc}); "
            "enlarge that mount (e.g. docker --shm-size) or lower kv_memory_bytes / num_pages"
        ) from exc
    os.close(fd)


def map_pool(path: Path, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Map an existing pool file as a tensor of ``shape``; writes are visible to every mapper."""
    nbytes = pool_nbytes(shape, dtype)
    size = path.stat().st_size
    if size != nbytes:
        raise RuntimeError(f"KV pool file {path} has {size} bytes, expected {nbytes}")
    numel = nbytes // torch.empty((), dtype=dtype).element_size()
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape)


def unlink_pool_files(paths: Iterable[Path]) -> None:
    for path in paths:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError:
            logger.exception("could not remove KV pool file %s", path)


def remove_stale_pool_files(directory: Path = SHM_DIR) -> int:
    """Remove the pool files of leaders that are gone; the bytes freed.

    A leader killed (SIGKILL, or SIGTERM before its handlers exist) between creating its
    followers' files and unlinking them (step 1 to 3 above) leaves them in ``/dev/shm`` with
    their full size reserved, and a restarted worker would leave more each time. The leader's
    pid is in every name (`new_group_name`); a file whose pid no longer runs is stale. A pid
    reused by another process keeps its files: never one of a live leader is removed.
    """
    freed = 0
    for path in directory.glob(f"{POOL_FILE_PREFIX}*"):
        pid_text = path.name.removeprefix(POOL_FILE_PREFIX).split("-", 1)[0]
        if not pid_text.isdigit():
            continue
        try:
            os.kill(int(pid_text), 0)
            continue  # alive (or another user's process: not ours to judge)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            continue  # another leader cleaned it meanwhile
        freed += size
        logger.warning("removed %s (%.1f MiB) of a leader that is gone", path, size / 2**20)
    return freed


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype
