"""The deadline sweep: what the progress thread checks every `SWEEP_PERIOD_S` besides the CQ.

A job may never end on its own (shm: a dead peer's ops never complete; tcp: rxm answers EAGAIN
while it retries an unreachable address, so its ops are never posted), so every accepted job
carries a deadline, and counters armed with a timeout must expire too. The sweep is its own
module because it decides why such a job ends, which the loop that posts and completes ops need
not know:

* A missed deadline fails the job's peer (`OperationTimeoutError`, through `PeerTable.fail`),
  which ends every unfinished job addressed to it.
* Unless the job waited only for this engine: nothing of it in flight, and its queue stopped
  by a shortage of context slots or send buffers (`ProgressLoop.starved`; e.g. all held by ops
  stranded at a failed peer). It then ends alone in `TransferError` naming the shortage: its
  peer never had a chance to fail. A provider's EAGAIN stays the peer's matter (rxm retrying
  an unreachable address refuses every post to it).
* shm completes transmits strictly in order per endpoint: an op to a dead peer never completes
  and holds back every later local completion, to any peer. A posted job to another peer that
  misses its deadline while a failed peer still has ops posted ends in `TransferError` ("blocked
  behind") and is stranded, without condemning its peer: its target may well have the data.
* On shm the sweep also fails peers whose process has exited (`PeerTable.fail_exited`): their
  posted ops would otherwise wait for their deadline.

Ordering: `admit` runs under the loop's lock as the loop inserts a job into `jobs` and keeps
deadlines non-decreasing in `jobs` (insertion) order, even when submitters race or wait for
room; so `sweep` stops at the first live deadline instead of scanning every job.

Threads: `admit` on submitting threads (under the lock), `sweep` on the progress thread only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from workers.fabric.callbacks import CallbackDispatcher
from workers.fabric.counters import ImmCounters
from workers.fabric.errors import FabricError, OperationTimeoutError, TransferError
from workers.fabric.jobs import WRITE, Job, ProgressStats
from workers.fabric.peers import PeerTable

# How often the progress thread sweeps: the slack an expired job may wait past its deadline.
SWEEP_PERIOD_S = 0.005


class DeadlineSweep:
    """Ends the jobs of one `ProgressLoop` that missed their deadline, and expires counters."""

    def __init__(
        self,
        *,
        lock: threading.Condition,
        jobs: dict[int, Job],
        stats: ProgressStats,
        peers: PeerTable,
        counters: ImmCounters,
        dispatcher: CallbackDispatcher,
        finish: Callable[[Job, FabricError], None],
        provider_name: str,
        starved: dict[int, str],
    ) -> None:
        # The progress loop's lock and job table: `jobs` is iterated only under `_lock`.
        self._lock = lock
        self._jobs = jobs
        self._stats = stats
        self._peers = peers
        self._counters = counters
        self._dispatcher = dispatcher
        self._finish = finish
        self._provider_name = provider_name
        self._starved = starved  # the loop's: fi_addr -> why its queue could not be posted
        self._ordered_tx_completions = provider_name == "shm"
        self._last_deadline = 0.0

    def admit(self, job: Job) -> None:
        """Raise ``job``'s deadline to the last admitted one (the caller holds the lock and
        inserts ``job`` into `jobs` next); a later acceptance bounds it."""
        job.deadline = max(job.deadline, self._last_deadline)
        self._last_deadline = job.deadline

    def sweep(self, now: float) -> None:
        """Expire counters and end every job whose deadline passed (progress thread)."""
        self._dispatcher.submit_all(self._counters.expire(now))
        peers = self._peers
        if peers.watches_exits:
            peers.fail_exited()  # its posted ops would otherwise wait for their deadline
        # `admit` keeps `jobs` (insertion-ordered) deadline-ordered.
        expired = []
        with self._lock:  # submitters insert into `jobs` under it
            for job in self._jobs.values():
                if job.deadline > now:
                    break
                if not job.finished:
                    expired.append(job)
        for job in expired:
            if job.finished:
                continue
            self._stats.timeouts += 1
            what = "write" if job.kind == WRITE else "message"
            shortage = self._starved.get(job.peer.fi_addr)
            if shortage is not None and job.completed >= job.posted:
                # Nothing of it is in flight, and its queue waits for this engine's own
                # resources: its peer is not to blame.
                self._finish(job, TransferError(
                    f"{what} to {job.peer.name}: {job.total - job.posted} of {job.total} ops "
                    f"never posted before the deadline: {shortage}"
                ))  # fmt: skip
                continue
            blocker = peers.wedging_peer() if self._ordered_tx_completions else None
            if blocker is not None and blocker.fi_addr != job.peer.fi_addr and job.posted:
                # shm completes transmits strictly in order per endpoint: an op to a dead peer
                # never completes and holds back every later completion. This peer may be fine
                # (its target saw the data), so fail the job without condemning the peer.
                self._finish(job, TransferError(
                    f"{what} to {job.peer.name}: local completion blocked behind operations to "
                    f"failed peer {blocker.name} ({self._provider_name} completes in order)"
                ))  # fmt: skip
                peers.strand(job)
                continue
            error = OperationTimeoutError(
                f"{what} to {job.peer.name} missed its deadline ({job.completed}/{job.total} "
                f"ops completed, {job.posted} posted): peer unreachable or dead"
            )
            peers.fail(job.peer, error)
