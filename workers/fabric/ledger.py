"""The progress loop's books: its live jobs, their ops in flight, and how each job ends.

* A job finishes exactly once: `on_done` after its last op completed, or `on_error` at its first
  error completion, its deadline, its peer's failure, or engine close. `finish` claims the job
  under `_finish_lock`, so the progress thread, the watchdog and shutdown can race on a job and
  still deliver one outcome.
* Ops of a finished job that are still posted keep it in `jobs`, so their late completions
  free their contexts quietly; it is forgotten (`forget_if_idle`) once none is, which releases
  its send buffer, its source region (`RegionUses.release`) and its peer's AV entry if that
  peer was forgotten meanwhile (`PeerTable.job_forgotten`).
* `jobs` is shared with the loop, the peer table and the deadline sweep; it is iterated only
  under the loop's lock (submitters insert into it under that lock).

Threads: the progress thread, except `claim`/`deliver`, which the watchdog also calls when it
abandons the loop.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from workers.fabric.callbacks import CallbackDispatcher
from workers.fabric.errors import FabricError
from workers.fabric.jobs import SEND, WRITE, Job, ProgressStats
from workers.fabric.messages import MessagePools
from workers.fabric.registration import RegionUses

log = logging.getLogger(__name__)


class JobLedger:
    """The jobs of one `ProgressLoop` by id, the ops posted and not completed, and outcomes."""

    def __init__(
        self,
        *,
        stats: ProgressStats,
        dispatcher: CallbackDispatcher,
        pools: MessagePools,
        region_uses: RegionUses,
        on_forgotten: Callable[[int], None],
    ) -> None:
        self.jobs: dict[int, Job] = {}
        # Ops posted whose completion (or error completion) has not been read yet.
        self.inflight = 0
        self._stats = stats
        self._dispatcher = dispatcher
        self._pools = pools
        self._region_uses = region_uses
        self._on_forgotten = on_forgotten  # fi_addr of a forgotten job
        self._finish_lock = threading.Lock()

    # -- ops --------------------------------------------------------------------------------------

    def posted(self, job: Job, count: int) -> None:
        """``count`` more ops of ``job`` were handed to the provider."""
        job.posted += count
        self.inflight += count
        self._stats.ops_posted += count

    def completed(self, job_id: int, count: int) -> None:
        """``count`` ops of job ``job_id`` completed (a CQ row); finish it after its last."""
        self.inflight -= count
        self._stats.ops_completed += count
        job = self.jobs.get(job_id)
        if job is None:
            return
        job.completed += count
        if job.stranded:
            self._stats.ops_stranded -= count
        if job.completed < job.total:
            self.forget_if_idle(job)
            return
        if job.kind == SEND:
            self._stats.messages_sent += 1
        else:
            self._stats.bytes_written += job.byte_count
        self.finish(job, None)

    def failed_op(self, job: Job) -> None:
        """One op of ``job`` ended in an error completion (the caller finishes the job)."""
        self.inflight -= 1
        job.completed += 1
        if job.stranded:
            self._stats.ops_stranded -= 1

    # -- outcomes -------------------------------------------------------------------------------

    def claim(self, job: Job) -> bool:
        """True for exactly one caller per job: the one that delivers its outcome."""
        with self._finish_lock:
            if job.finished:
                return False
            job.finished = True
            return True

    def deliver(self, job: Job, error: FabricError | None, *, exact: bool = True) -> None:
        """Queue the job's outcome. A failed write job first reports the ops it never posted
        (``on_unposted``): a peer failed, a deadline passed or the engine closed while they
        waited in its queue. ``exact``: False where another thread may be posting right now
        (the watchdog), so the number is not known and nothing is reported as unposted."""
        if error is None:
            if job.on_done is not None:
                self._dispatcher.submit(job.on_done)
            return
        unposted = job.on_unposted if job.kind == WRITE and job.posted < job.total else None
        if exact and unposted is not None and job.arrays is not None:
            lens = job.arrays[1]
            num_bytes = sum(int(lens[i]) for i in range(job.posted, job.total))
            self._dispatcher.submit(unposted, job.total - job.posted, num_bytes, error)
        if job.on_error is not None:
            self._dispatcher.submit(job.on_error, error)
        else:
            log.warning("unhandled fabric error: %s", error)

    def finish(self, job: Job, error: FabricError | None) -> None:
        """Deliver the job's one outcome; forget it once no op of it is posted."""
        if self.claim(job):
            if job.send_slot >= 0 and job.completed == job.posted:
                self._pools.release_send_slot(job.send_slot)
                job.send_slot = -1
            self.deliver(job, error)
        self.forget_if_idle(job)

    def forget_if_idle(self, job: Job) -> None:
        if job.finished and job.completed >= job.posted and job.job_id in self.jobs:
            del self.jobs[job.job_id]
            if job.send_slot >= 0:
                self._pools.release_send_slot(job.send_slot)
                job.send_slot = -1
            if job.region is not None:
                self._region_uses.release(job.region)
            self._on_forgotten(job.peer.fi_addr)
