"""Peer life cycle of one endpoint: which handle an fi_addr answers to, which peers failed and
why, when a forgotten peer's address-vector entry may go, and (shm) whose process has exited.

Life cycle of a peer handle (`PeerHandle`, keyed by `fi_addr`):

    `adopt` (add_peer) -> current: jobs accepted -> `retire` (forget_peer) -> retiring: no new
    jobs -> AV entry removed (`fi_av_remove`) once no job addressed to it is left

* Jobs are accepted only for the current handle of an fi_addr (`check_accepts`). A retired
  handle's AV entry is removed only once no job addressed to it is left, since ops in progress
  on a removed address are undefined (fi_av(3)); added again before that (`reclaim`), the
  address keeps its entry rather than insert it twice.
* A failed peer (`fail`: a connection error, a missed deadline, an exited process) stays
  failed until it is retired or its slot goes to another address; every unfinished job
  addressed to it ends with the error. Failing a forgotten handle ends only its own jobs: its
  address may serve a new process now (or its AV slot another peer). `peer_failures` keeps
  why: a later definite cause replaces a missed deadline.
* Ops of a finished job still posted to a failed peer (or, on shm, held behind one) may never
  complete: `strand` counts them (`ProgressStats.ops_stranded`) so they do not keep the
  progress thread spinning.
* shm: a peer SIGKILLed while it held its region's spinlock (shm's receiver holds it while it
  copies a command's data) leaves the lock held forever, and libfabric 1.17 takes that lock
  on every post to the peer: the post would spin forever. The peer's process is therefore
  watched through a pidfd (opened at its first post, pid taken from its `fi_shm://<pid>:...`
  name) and, once it has exited, the peer is failed and never posted to again.

Threads: everything here runs on the progress thread (or inline before it starts), except
`check_accepts` (submitters, under the lock), `failure` (any thread, no lock: a failure is
recorded before its peer is marked failed, and the mark cleared before the failure) and the
watchdog, which asks `has_exited` of the peer a stuck post is addressed to (a killed peer may
die holding its lock after the post began), and `exited_peers` when any call is stuck, and
marks them failed under the lock. The lock is the progress loop's, shared: the current
handles change only under it, and the loop's `jobs` is iterated only under it.
"""

from __future__ import annotations

import logging
import os
import re
import select
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from workers.fabric._lib import lib, strerror
from workers.fabric.errors import (
    AddressError,
    FabricError,
    OperationTimeoutError,
    PeerFailedError,
)
from workers.fabric.handles import PeerHandle

if TYPE_CHECKING:
    from workers.fabric._fabric_cffi import PdEngine
    from workers.fabric.jobs import Job, ProgressStats

log = logging.getLogger(__name__)

_SHM_PID = re.compile(rb"^fi_shm://(\d+):")


class PeerTable:
    """The peers of one `ProgressLoop`: current and retiring handles, failures, exit watches."""

    def __init__(
        self,
        native: PdEngine,
        *,
        lock: threading.Condition,
        jobs: dict[int, Job],
        stats: ProgressStats,
        finish: Callable[[Job, FabricError], None],
        watch_exits: bool,
    ) -> None:
        self.native = native
        # The progress loop's lock and job table: `jobs` is iterated only under `_lock`.
        self._lock = lock
        self._jobs = jobs
        self._stats = stats
        self._finish = finish
        # shm: peers' processes are watched so a dead one is never posted to (module docstring).
        self.watches_exits = watch_exits
        self._exit_fds: dict[bytes, int | None] = {}  # peer address -> pidfd (None: untracked)
        self._fd_peers: dict[int, PeerHandle] = {}
        self._exit_poll = select.poll()
        self.failed_peers: set[int] = set()
        # fi_addr -> the peer's current handle (only its jobs are accepted), and fi_addr ->
        # forgotten handle whose AV entry is removed once no job of it is left (`retire`).
        self._current_peers: dict[int, PeerHandle] = {}
        self._retiring: dict[int, PeerHandle] = {}
        # Why each failed peer failed (a later definite cause replaces a missed deadline).
        self.peer_failures: dict[int, FabricError] = {}

    # -- any thread -----------------------------------------------------------------------------

    def check_accepts(self, peer: PeerHandle) -> None:
        """Raise unless jobs for ``peer`` are accepted (the caller holds the lock)."""
        if self._current_peers.get(peer.fi_addr) is not peer:
            raise AddressError(f"peer {peer.name} was forgotten or never added")
        if peer.fi_addr in self.failed_peers:
            raise PeerFailedError(f"peer {peer.name} has failed")

    def failure(self, fi_addr: int) -> FabricError | None:
        """Why the peer at ``fi_addr`` failed (None: it has not); takes no lock."""
        if fi_addr not in self.failed_peers:
            return None
        return self.peer_failures.get(fi_addr)

    # -- failure (on the progress thread) -------------------------------------------------------

    def fail(self, peer: PeerHandle, error: FabricError) -> None:
        """Mark the peer failed and fail every unfinished job addressed to it."""
        if self._current_peers.get(peer.fi_addr) is not peer:
            # A forgotten handle: its address may serve a new process now (or its AV slot
            # another peer), which this must not condemn. Only its own jobs end.
            with self._lock:
                jobs = [j for j in self._jobs.values() if j.peer is peer]
            for job in jobs:
                self._finish(job, error)
                self.strand(job)
            return
        if peer.fi_addr not in self.failed_peers:
            log.warning("peer %s failed: %s", peer.name, error)
        with self._lock:
            self.record_failure(peer.fi_addr, error)
            jobs = [j for j in self._jobs.values() if j.peer.fi_addr == peer.fi_addr]
        for job in jobs:
            self._finish(job, error)
            self.strand(job)

    def record_failure(self, fi_addr: int, error: FabricError) -> None:
        """Mark the peer at ``fi_addr`` failed because of ``error`` (the caller holds the lock);
        a definite cause replaces a missed deadline, never the other way round."""
        known = self.peer_failures.get(fi_addr)
        if known is None or isinstance(known, OperationTimeoutError):
            self.peer_failures[fi_addr] = error  # before the mark: readers take no lock
        self.failed_peers.add(fi_addr)

    def clear_failure(self, fi_addr: int) -> None:
        """Forget that the peer at ``fi_addr`` failed (mark first: readers take no lock)."""
        self.failed_peers.discard(fi_addr)
        self.peer_failures.pop(fi_addr, None)

    def strand(self, job: Job) -> None:
        """A finished job's ops still posted to a failed peer (or, on shm, held behind one)
        may never complete: count them as stranded so they do not keep the thread spinning."""
        if job.finished and not job.stranded and job.posted > job.completed:
            job.stranded = True
            self._stats.ops_stranded += job.posted - job.completed

    def wedging_peer(self) -> PeerHandle | None:
        """A failed peer with operations still posted (they will never complete on shm)."""
        with self._lock:
            for job in self._jobs.values():
                if (
                    job.finished
                    and job.posted > job.completed
                    and job.peer.fi_addr in self.failed_peers
                ):
                    return job.peer
        return None

    # -- handles (on the progress thread: `ProgressLoop.call`) ----------------------------------

    def adopt(self, peer: PeerHandle) -> None:
        """``peer`` is now the handle of its fi_addr: jobs for it are accepted."""
        with self._lock:
            self._current_peers[peer.fi_addr] = peer

    def reclaim(self, address: bytes) -> int | None:
        """The fi_addr of a forgotten ``address`` whose AV entry is still there (its jobs
        have not all ended): added again, it keeps that entry rather than insert it twice."""
        with self._lock:
            for fi_addr, old in self._retiring.items():
                if old.address == address:
                    del self._retiring[fi_addr]
                    break
            else:
                return None
        self._unwatch(address)  # the new handle is watched (and failed) at its first post
        return fi_addr

    def retire(self, peer: PeerHandle) -> None:
        """Forget ``peer`` (`TransferEngine.forget_peer`): no new jobs for the handle, its
        failed state cleared, and its AV entry removed once no job addressed to it is left
        (fi_av(3): operations in progress on a removed address are undefined)."""
        with self._lock:
            if self._current_peers.get(peer.fi_addr) is peer:
                del self._current_peers[peer.fi_addr]
            self.clear_failure(peer.fi_addr)
            self._retiring[peer.fi_addr] = peer
        self._remove_if_unused(peer.fi_addr)

    def job_forgotten(self, fi_addr: int) -> None:
        """A job addressed to ``fi_addr`` is gone: a retired entry may be removed now."""
        if fi_addr in self._retiring:
            self._remove_if_unused(fi_addr)

    def _remove_if_unused(self, fi_addr: int) -> None:
        with self._lock:
            if fi_addr in self._current_peers:  # the provider handed the slot out again
                self._retiring.pop(fi_addr, None)
                return
            if fi_addr not in self._retiring:
                return
            if any(job.peer.fi_addr == fi_addr for job in self._jobs.values()):
                return  # a job still queued or with ops posted (e.g. to a dead shm peer)
            peer = self._retiring.pop(fi_addr)
        self._unwatch(peer.address)
        rc = lib.pd_av_remove(self.native, fi_addr)
        if rc != 0:
            log.warning("fi_av_remove of peer %s: %s (%d)", peer.name, strerror(rc), rc)
            return
        self._stats.peers_removed += 1

    # -- shm peer processes (on the progress thread) --------------------------------------------

    def watch(self, peer: PeerHandle) -> None:
        """Open a pidfd on the peer's process at the first post to it (`watches_exits` only);
        fail it if it is gone."""
        if peer.address in self._exit_fds:
            return
        fd: int | None = None
        match = _SHM_PID.match(peer.address)
        pid = int(match.group(1)) if match else 0
        if pid and pid != os.getpid():
            try:
                fd = os.pidfd_open(pid)
            except (OSError, AttributeError):
                # Not visible here (another pid namespace, or already gone) or no pidfd
                # support: only the deadline and the watchdog cover this peer.
                log.debug("cannot watch process %d of shm peer %s", pid, peer.name)
        self._exit_fds[peer.address] = fd
        if fd is not None:
            self._fd_peers[fd] = peer
            self._exit_poll.register(fd, select.POLLIN)
            self.fail_exited()

    def has_exited(self, peer: PeerHandle) -> bool:
        """Whether ``peer``'s watched process has exited. Any thread: the watchdog asks while
        the progress thread is stuck posting to it (and so changes no watch)."""
        fd = self._exit_fds.get(peer.address)
        if fd is None:
            return False
        try:
            readable, _, _ = select.select([fd], [], [], 0)
        except (OSError, ValueError):  # closed meanwhile: the progress thread returned
            return False
        return bool(readable)

    def exited_peers(self) -> list[PeerHandle]:
        """The current handles of every watched peer whose process has exited. The watchdog
        asks while the progress thread is stuck (so no watch changes meanwhile)."""
        exited = []
        for peer in list(self._fd_peers.values()):
            current = self._current_handle(peer)
            if current is not None and self.has_exited(peer):
                exited.append(current)
        return exited

    def _current_handle(self, peer: PeerHandle) -> PeerHandle | None:
        """The current handle of ``peer``'s address (None: its slot now serves another)."""
        current = self._current_peers.get(peer.fi_addr)
        return current if current is not None and current.address == peer.address else None

    def _unwatch(self, address: bytes) -> None:
        fd = self._exit_fds.pop(address, None)
        if fd is not None and self._fd_peers.pop(fd, None) is not None:
            self._exit_poll.unregister(fd)
            os.close(fd)

    def fail_exited(self) -> None:
        """Fail every watched peer whose process has exited (one poll(2) for all of them)."""
        if not self._fd_peers:
            return
        for fd, _events in self._exit_poll.poll(0):
            peer = self._fd_peers.pop(fd)
            self._exit_poll.unregister(fd)
            os.close(fd)
            self._exit_fds[peer.address] = None
            # The process behind the address is gone: fail the address's current handle too
            # (the watch may have been opened by a forgotten one of the same address).
            peer = self._current_handle(peer) or peer
            self.fail(peer, PeerFailedError(f"peer {peer.name}: its process has exited"))

    def close_watches(self) -> None:
        """Close every pidfd (engine shutdown)."""
        for fd in self._fd_peers:
            os.close(fd)
        self._fd_peers.clear()
