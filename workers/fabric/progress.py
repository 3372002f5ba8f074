"""The progress thread: after construction, the only thread that touches the endpoint.

Life cycle of a submission (`Job`, keyed by `job_id`):

    caller validates -> `pending[peer]` (FIFO per peer, bounded in total) -> posted op by op
    by this thread -> in `jobs` until every posted op completed -> removed

* Posting a peer's queue stops at `-FI_EAGAIN` or when the native context pool is empty; the
  job stays at the head of that peer's queue and is retried after the next CQ drain. Messages
  to a peer therefore keep submission order, and a peer that cannot take work (rxm answers
  EAGAIN while it retries a connection to an unreachable address) never blocks the others.
  A queue stopped by this engine's own shortage (no free context slot or send buffer: they
  may all be held by ops stranded at a failed peer) is "starved" (`starved`): its jobs that
  miss their deadline then end alone, without condemning their peer (`deadlines`).
* A write job holds its source region from `enqueue` until it is forgotten, so that a
  deregistered region is closed only after its last job (`registration.RegionUses`).
* How a job ends (exactly once) and when it is forgotten: `ledger.JobLedger`. Ops of a failed
  peer (or, on shm, held behind one) may never complete: they are "stranded"
  (`ProgressStats.ops_stranded`) and, unlike live ops, do not keep the thread spinning; it
  sleeps on the CQ as when idle and still frees them if they do complete.
* Other threads reach the endpoint only through `call()` (register, add_peer, forget_peer),
  which runs the function here; the domain is therefore opened with FI_THREAD_DOMAIN. The
  receive buffers are posted before the thread starts, by the constructing thread.
* Peers (`peers.PeerTable`, sharing this loop's lock and `jobs`): jobs are accepted only for
  the current handle of an fi_addr. `forget_peer` retires the handle; its address-vector entry
  is removed (`fi_av_remove`) once no job addressed to it is left, since ops in progress on a
  removed address are undefined (fi_av(3)). A failed peer's jobs end with its failure.
* The CQ drain, with the order in which it queues callbacks: `completions.CompletionDrain`.
  Waking this thread from its CQ wait: `wakeup.Waker`.
* The loop's work ends in `_shutdown` (its thread) or `_abandon` (the watchdog's); `on_ended`
  then runs there, so the engine can complete a `close` that could not wait for the thread.

Every accepted job ends in exactly one callback within its deadline plus a bounded slack:

* The ledger claims a job before delivering its outcome (`JobLedger.claim`), so the progress
  thread, the watchdog and shutdown can race on a job and still deliver one outcome.
* `jobs` is iterated only under `_lock` (submitters insert into it under that lock).
* Every `deadlines.SWEEP_PERIOD_S` this thread runs the deadline sweep
  (`deadlines.DeadlineSweep`), which ends the jobs that missed their deadline and expires
  counters; `enqueue` admits each job to it under the lock, which keeps deadlines in `jobs`
  order so the sweep may stop at the first live one.
* shm: a peer SIGKILLed while it held its region's spinlock leaves the lock held forever,
  and libfabric 1.17 takes that lock on every post to the peer: the post would spin forever.
  The peer's process is therefore watched through a pidfd (`PeerTable.watch`, at its first
  post) and, once it has exited, the peer is failed and never posted to again.
* A watchdog thread (`watchdog.Watchdog`) covers what that cannot (a peer dying while we wait
  on its lock, any other provider call that never returns). It reads `native_call()`, which
  this thread keeps current around each post and poll by plain attribute stores (no lock).
  When one native call has not returned for `watchdog._STALL_S` it calls `_abandon`, which
  fails every outstanding job (`PeerFailedError` for each watched peer whose process has
  exited, recorded as its failure: killed while it held its lock, it stalls a post to it or
  a CQ poll that progresses its commands; `PeerStuckError` for a live peer being posted to:
  it may only be stopped, so that is no proof of its death; `EngineClosedError` for the
  rest), fails pending `call()`s and armed counters (which then refuse arming: nothing would
  fire or expire them), and refuses new work. The stuck thread, should it ever return, finds
  every job already finished. `_abandon` stays here, beside `_shutdown`: both end the loop's
  work and act on the state its lock guards.

So this module is the loop itself: queues, posting, the thread's passes, and how the loop ends.
Posting stays here (tests replace this module's `lib` to make a post hang).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from workers.fabric._lib import ffi, lib, strerror
from workers.fabric.callbacks import CallbackDispatcher, Fire
from workers.fabric.completions import NAP_WAIT_US, CompletionDrain
from workers.fabric.counters import ImmCounters
from workers.fabric.deadlines import SWEEP_PERIOD_S, DeadlineSweep
from workers.fabric.errors import (
    EngineClosedError,
    FabricError,
    PeerFailedError,
    PeerStuckError,
    SubmitQueueFullError,
    TransferError,
)
from workers.fabric.handles import MemoryRegionHandle, PeerHandle
from workers.fabric.jobs import SEND, WRITE, Job, ProgressStats
from workers.fabric.ledger import JobLedger
from workers.fabric.messages import MessagePools
from workers.fabric.peers import PeerTable
from workers.fabric.registration import RegionUses
from workers.fabric.wakeup import Waker
from workers.fabric.watchdog import Watchdog

if TYPE_CHECKING:
    from workers.fabric._fabric_cffi import PdEngine

log = logging.getLogger(__name__)

_BLOCKED_WAIT_US = 500


class ProgressLoop:
    def __init__(
        self,
        native: PdEngine,
        *,
        name: str,
        counters: ImmCounters,
        dispatcher: CallbackDispatcher,
        pools: MessagePools,
        max_queued_submits: int,
        spin_us: int,
        idle_spin_us: int,
        idle_wait_us: int,
        provider_name: str,
        regions: dict[int, MemoryRegionHandle],
        on_ended: Callable[[], None],
    ) -> None:
        self.native = native
        self.provider_name = provider_name
        self.counters = counters
        self.dispatcher = dispatcher
        self.pools = pools
        self.stats = ProgressStats()
        self.pending: dict[int, collections.deque[Job]] = {}
        self._num_queued = 0
        self._commands: collections.deque[tuple[Callable[[], Any], Future[Any]]] = (
            collections.deque()
        )
        self._lock = threading.Condition()
        # The engine's registered regions (shared; removed from only here, under `_lock`) and
        # the jobs writing from each.
        self.regions = RegionUses(regions, self._lock)
        self.ledger = JobLedger(
            stats=self.stats,
            dispatcher=dispatcher,
            pools=pools,
            region_uses=self.regions,
            on_forgotten=lambda fi_addr: self.peers.job_forgotten(fi_addr),
        )
        self.jobs = self.ledger.jobs
        # fi_addr -> why its queue's head could not be posted, when that was this engine's
        # shortage rather than the provider refusing the peer (progress thread only).
        self.starved: dict[int, str] = {}
        self._on_ended = on_ended
        self.work_ended = False
        # Peer handles, failures and (shm) process watches; shares `_lock` and `jobs`.
        self.peers = PeerTable(
            native,
            lock=self._lock,
            jobs=self.jobs,
            stats=self.stats,
            finish=self.ledger.finish,
            watch_exits=provider_name == "shm",
        )
        # Ends jobs past their deadline, on this thread every `SWEEP_PERIOD_S`; shares `_lock`
        # and `jobs` too.
        self._deadlines = DeadlineSweep(
            lock=self._lock,
            jobs=self.jobs,
            stats=self.stats,
            peers=self.peers,
            counters=counters,
            dispatcher=dispatcher,
            finish=self.ledger.finish,
            provider_name=provider_name,
            starved=self.starved,
        )
        self._drain = CompletionDrain(
            native,
            ledger=self.ledger,
            peers=self.peers,
            counters=counters,
            dispatcher=dispatcher,
            pools=pools,
            stats=self.stats,
            on_wait_fd_dropped=self._nap_when_idle,
        )
        self.waker = Waker(native)
        self._max_queued = max_queued_submits
        self._spin_us = spin_us
        self._idle_spin_s = idle_spin_us / 1e6
        self._idle_wait_us = idle_wait_us
        self._stopping = False
        self._stopped = False
        self._next_job_id = 1
        # Start of the post/poll call in progress (0.0: none) and the peer it posts to, for the
        # watchdog (`native_call`): the peer is stored before the start, the start cleared after.
        self._native_since = 0.0
        self._native_peer: PeerHandle | None = None
        self._wedged = ""
        self._watchdog = Watchdog(
            name=f"{name}-watchdog", probe=self.native_call, on_stall=self._abandon
        )
        self._rc = ffi.new("int *")  # where `pd_post_writes` reports why it stopped
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    # -- called from any thread ---------------------------------------------------------------

    def start(self) -> None:
        """Post the receive buffers, then start the threads. Posting here, before the progress
        thread owns the endpoint, makes a refusal (e.g. too few context slots) an exception of
        the engine's constructor rather than the death of a thread nobody watches."""
        self.pools.post_all_receives(self.native)
        self.thread.start()
        self._watchdog.start()

    def new_job_id(self) -> int:
        with self._lock:
            job_id = self._next_job_id
            self._next_job_id += 1
            return job_id

    def enqueue(self, job: Job, timeout: float) -> None:
        """Queue a job; blocks while the queue is full, at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._num_queued >= self._max_queued and not self._stopping:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SubmitQueueFullError(
                        f"{self._num_queued} submissions still queued after {timeout:.3g} s"
                    )
                self._lock.wait(remaining)
            if self._stopping:
                raise EngineClosedError(self._wedged or "engine is closed")
            self.peers.check_accepts(job.peer)
            if job.region is not None:
                self.regions.hold(job.region)
            self._deadlines.admit(job)  # before the insert: keeps `jobs` deadline-ordered
            self.jobs[job.job_id] = job
            self.pending.setdefault(job.peer.fi_addr, collections.deque()).append(job)
            self._num_queued += 1
        self.waker.wake(deferrable=True)

    def call(self, function: Callable[[], Any]) -> Any:
        """Run `function` on the progress thread (or inline before it starts) and return."""
        if not self.thread.is_alive():
            if self._stopped or self._stopping:
                raise EngineClosedError("engine is closed")
            return function()
        future: Future[Any] = Future()
        with self._lock:
            if self._stopping:
                raise EngineClosedError(self._wedged or "engine is closed")
            self._commands.append((function, future))
        self.waker.wake()
        return future.result()

    @property
    def abandoned(self) -> bool:
        """The watchdog gave up on this loop (`_abandon`)."""
        return bool(self._wedged)

    def closed_reason(self) -> str | None:
        """Why the loop takes no more work (stopping, abandoned, or its thread died); None
        while it runs."""
        if self._stopping or self._stopped:
            return self._wedged or "engine is closed"
        return None

    def native_call(self) -> tuple[float, PeerHandle | None]:
        """The native call in progress (watchdog thread): its start and the peer it posts to
        (None: the CQ poll), or (0.0, None) when none is. The start is read again after the
        peer, so a pair is only returned when both belong to the same call."""
        since = self._native_since
        peer = self._native_peer
        if since and self._native_since == since:
            return since, peer
        return 0.0, None

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        self.waker.wake()

    def detach_native(self) -> None:
        """The engine is about to free the native endpoint: later wakes do nothing."""
        self.waker.detach()

    def wakes_deferred(self) -> contextlib.AbstractContextManager[None]:
        """Submissions (`enqueue`) by this thread inside the block wake the thread once, at its
        end; `call` and `stop` still wake it at once (they wait for it or must not wait)."""
        return self.waker.deferred()

    # -- the progress thread ----------------------------------------------------------------

    def _run(self) -> None:
        last_activity = time.monotonic()
        next_check = last_activity + SWEEP_PERIOD_S
        waker = self.waker
        try:
            while not self._stopping:
                self._run_commands()
                posted = self._post_pending()
                spin, wait = self._spin_us, 0
                # Stranded ops may never complete: polling (in the waits too) still frees
                # their contexts if they do, but they are no reason to spin a core.
                live = self.ledger.inflight - self.stats.ops_stranded
                if self.pending and not (posted or live):
                    # Every queue is refused (EAGAIN): let the provider progress without
                    # spinning a core until the peers' deadlines.
                    spin, wait = 0, _BLOCKED_WAIT_US
                elif not (live or self.pending or self._commands) and (
                    time.monotonic() - last_activity >= self._idle_spin_s
                ):
                    spin, wait = 0, self._idle_wait_us
                    # Set before the final check: a submitter that queues after it sees the
                    # flag and wakes us through the eventfd.
                    waker.sleeping = True
                    if self.pending or self._commands or self._stopping:
                        waker.sleeping = False
                        continue
                if wait:
                    self.stats.sleeps += 1
                try:
                    if self._poll(spin, wait):
                        last_activity = time.monotonic()
                finally:
                    waker.sleeping = False  # a raise must not leave later wakes signalling
                now = time.monotonic()
                if now >= next_check:
                    self._deadlines.sweep(now)
                    next_check = now + SWEEP_PERIOD_S
        except Exception:
            log.exception("fabric progress thread failed; failing all operations")
        finally:
            self._shutdown()

    def _run_commands(self) -> None:
        while self._commands:
            function, future = self._commands.popleft()
            try:
                future.set_result(function())
            except BaseException as exc:
                future.set_exception(exc)

    def _poll(self, spin_us: int, wait_us: int) -> bool:
        self._native_peer = None
        self._native_since = time.monotonic()
        n = self._drain.read(spin_us, wait_us)
        self._native_since = 0.0
        return self._drain.dispatch(n)

    def _nap_when_idle(self) -> None:
        """The CQ wait fd was dropped: idle waits are timed naps, short enough to notice
        traffic (`completions`)."""
        self._idle_wait_us = min(self._idle_wait_us, NAP_WAIT_US)

    def _post_pending(self) -> bool:
        """Post from every peer's queue; True if any operation was posted."""
        before = self.stats.ops_posted
        peers = self.peers
        if peers.watches_exits and self.pending:
            peers.fail_exited()  # right before posting: never post to a dead process
        for fi_addr, queue in list(self.pending.items()):
            shortage = None
            while queue:
                job = queue[0]
                if peers.watches_exits:
                    peers.watch(job.peer)  # may fail the peer (and so this job) at once
                if not job.finished:
                    blocked = self._post_writes(job) if job.kind == WRITE else self._post_send(job)
                    if blocked:
                        shortage = self._shortage(job)
                        break
                self._pop_pending(fi_addr, queue)
                self.ledger.forget_if_idle(job)
            if shortage is None:
                self.starved.pop(fi_addr, None)
            else:
                self.starved[fi_addr] = shortage
        return self.stats.ops_posted != before

    def _shortage(self, job: Job) -> str | None:
        """Why ``job`` could not be posted when that is this engine's own shortage; None when
        the provider refused it (EAGAIN: a matter of its peer, e.g. one being connected)."""
        if job.kind == SEND and job.send_slot < 0:
            return f"all {self.pools.num_sends} send buffers are held by messages in flight"
        if lib.pd_engine_free_slots(self.native) == 0:
            return (
                f"no free operation slot ({self.ledger.inflight} operations posted, "
                f"{self.stats.ops_stranded} of them stranded at failed peers)"
            )
        return None

    def _pop_pending(self, fi_addr: int, queue: collections.deque[Job]) -> None:
        with self._lock:
            queue.popleft()
            self._num_queued -= 1
            # Under the lock: a submitter appending to this deque must not lose its job.
            if not queue:
                del self.pending[fi_addr]
            self._lock.notify()

    def _post_writes(self, job: Job) -> bool:
        """Post what the provider accepts; True when the job must wait for progress."""
        assert job.arrays is not None and job.region is not None  # every write job has both
        laddr, lens, raddr = job.arrays
        start = job.posted
        imm = job.imm if job.imm is not None else 0
        self._native_peer = job.peer
        self._native_since = time.monotonic()
        posted = lib.pd_post_writes(
            self.native, job.total - start, laddr + start, lens + start, job.region.desc,
            job.peer.fi_addr, raddr + start, job.key, int(job.imm is not None), imm,
            job.job_id, self._rc,
        )  # fmt: skip
        self._native_since = 0.0
        self.ledger.posted(job, posted)
        if job.posted == job.total:
            return False
        rc = self._rc[0]
        if rc == -lib.FI_EAGAIN:
            self.stats.eagain_retries += 1
            return True
        self.ledger.finish(
            job, TransferError(f"posting a write to {job.peer.name}: {strerror(rc)}", -rc)
        )
        return False

    def _post_send(self, job: Job) -> bool:
        if job.send_slot < 0:
            job.send_slot = self.pools.take_send_slot(job.payload)
            if job.send_slot < 0:
                return True
        buffer, length = self.pools.send_buffer(job.send_slot)
        self._native_peer = job.peer
        self._native_since = time.monotonic()
        rc = lib.pd_post_send(
            self.native, buffer, length, self.pools.send_desc, job.peer.fi_addr, job.job_id
        )
        self._native_since = 0.0
        if rc == -lib.FI_EAGAIN:
            self.stats.eagain_retries += 1
            return True
        if rc != 0:
            self.ledger.finish(
                job, TransferError(f"posting a send to {job.peer.name}: {strerror(rc)}", -rc)
            )
            return False
        self.ledger.posted(job, 1)
        return False

    # -- ending: abandoned by the watchdog, or shut down --------------------------------------

    def _abandon(self, peer: PeerHandle | None, stalled_s: float) -> None:
        """The progress thread is stuck in the provider (`Watchdog`'s `on_stall`, on its
        thread): end everything it owes, refuse more."""
        call = f"posting to peer {peer.name}" if peer is not None else "polling the CQ"
        reason = (
            f"fabric progress thread stuck in {self.provider_name} ({call} has not returned "
            f"for {stalled_s:.1f} s); engine abandoned"
        )
        # Each watched peer whose process has exited is failed as such, whatever call is stuck:
        # proof of death, so whoever offered it pages may free them (nothing of it can write any
        # more). A peer killed while it held its region lock may stall a post to it (after the
        # post began) or a CQ poll that progresses its commands.
        failures: dict[int, FabricError] = {
            exited.fi_addr: PeerFailedError(f"peer {exited.name}: its process has exited")
            for exited in self.peers.exited_peers()
        }
        if peer is not None and peer.fi_addr not in failures:
            # Not proof that the peer's process is gone: it may only be stopped.
            failures[peer.fi_addr] = PeerStuckError(f"{peer.name}: {reason}")
        with self._lock:
            if self._wedged or self._stopped:
                return
            self._wedged = reason
            self._stopping = True
            for fi_addr, error in failures.items():
                self.peers.record_failure(fi_addr, error)
            commands = list(self._commands)
            self._commands.clear()
            jobs = list(self.jobs.values())
            self._lock.notify_all()
        log.error("%s", reason)
        for _function, future in commands:
            future.set_exception(EngineClosedError(reason))
        ledger = self.ledger
        for job in jobs:
            if ledger.claim(job):  # send slots stay with the stuck thread
                # The stuck thread may be posting this job's ops: their count is not known.
                error = failures.get(job.peer.fi_addr) or EngineClosedError(reason)
                ledger.deliver(job, error, exact=False)
        self.dispatcher.submit_all(self.counters.fail_all(EngineClosedError(reason)))
        self._end_work()

    def _end_work(self) -> None:
        self.work_ended = True
        self._on_ended()

    def _shutdown(self) -> None:
        try:
            with self._lock:
                self._stopping = True
                commands = list(self._commands)
                self._commands.clear()
                self._lock.notify_all()
            closed = EngineClosedError("engine closed before the operation completed")
            for _function, future in commands:
                future.set_exception(EngineClosedError("engine is closed"))
            with self._lock:
                jobs = list(self.jobs.values())
            for job in jobs:
                self.ledger.finish(job, closed)
            fires: list[Fire] = self.counters.fail_all(EngineClosedError("engine closed"))
            self.dispatcher.submit_all(fires)
            self.peers.close_watches()
            # Whatever the watchdog delivers is queued before the caller closes the dispatcher.
            self._watchdog.stop()
            self._stopped = True
        finally:
            # Even after a raise above: else every `close` would wait for a thread that ended.
            self._end_work()
