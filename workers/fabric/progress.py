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
* A write job holds its source region (`Job.region`) until it is forgotten: `release_region`
  (`deregister`) closes a region's registration at once when no job uses it, else when the
  last one is forgotten (closing it under a queued or posted op is a use-after-free).
* A job finishes exactly once: `on_done` after its last op completed, or `on_error` at its first
  error completion, its deadline, its peer's failure, or engine close. Ops of a finished job that
  are still posted stay in `jobs` so their late completions free their contexts quietly. Those
  of a failed peer (or, on shm, held behind one) may never complete: they are "stranded"
  (`ProgressStats.ops_stranded`) and, unlike live ops, do not keep the thread spinning; it
  sleeps on the CQ as when idle and still frees them if they do complete.
* Other threads reach the endpoint only through `call()` (register, add_peer, forget_peer),
  which runs the function here; the domain is therefore opened with FI_THREAD_DOMAIN. The
  receive buffers are posted before the thread starts, by the constructing thread.
* Peers (`peers.PeerTable`, sharing this loop's lock and `jobs`): jobs are accepted only for
  the current handle of an fi_addr. `forget_peer` retires the handle; its address-vector entry
  is removed (`fi_av_remove`) once no job addressed to it is left, since ops in progress on a
  removed address are undefined (fi_av(3)). A failed peer's jobs end with its failure.
* Callbacks are queued in CQ order: imm arrivals are handed to the counters before any later
  row of the same drain (a message, a local completion) is dispatched.
* The loop's work ends in `_shutdown` (its thread) or `_abandon` (the watchdog's); `on_ended`
  then runs there, so the engine can complete a `close` that could not wait for the thread.

Every accepted job ends in exactly one callback within its deadline plus a bounded slack:

* `_finish` claims the job under `_finish_lock`, so the progress thread, the watchdog and
  shutdown can race on a job and still deliver one outcome.
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
  fails every outstanding job (`PeerStuckError` for the peer being posted to, recorded as
  its failure: it may only be stopped, so that is no proof of its death; `EngineClosedError`
  for the rest), fails pending `call()`s and armed counters (which then
  refuse arming: nothing would fire or expire them), and refuses new work. The stuck thread,
  should it ever return, finds every job already finished. `_abandon` stays here, beside
  `_shutdown`: both end the loop's work and act on the state its lock guards.

The job record and the loop's counters are in `workers.fabric.jobs`, the deadline sweep and the
watchdog in modules of their own, so that this one is the loop: queues, posting, the CQ drain,
job outcomes, and how the loop ends.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from workers.fabric._lib import ffi, lib, strerror
from workers.fabric.callbacks import CallbackDispatcher, Fire
from workers.fabric.counters import ImmCounters
from workers.fabric.deadlines import SWEEP_PERIOD_S, DeadlineSweep
from workers.fabric.errors import (
    EngineClosedError,
    FabricError,
    PeerFailedError,
    PeerStuckError,
    RegistrationError,
    SubmitQueueFullError,
    TransferError,
)
from workers.fabric.handles import MemoryRegionHandle, PeerHandle
from workers.fabric.jobs import SEND, WRITE, Job, ProgressStats
from workers.fabric.messages import MessagePools
from workers.fabric.peers import PeerTable
from workers.fabric.watchdog import Watchdog

log = logging.getLogger(__name__)

_POLL_ROWS = 256
_BLOCKED_WAIT_US = 500
# errno values that mean the connection to the peer is gone, not that one operation was bad.
_CONNECTION_ERRORS = {32, 103, 104, 107, 110, 111, 112, 113}  # EPIPE ECONNABORTED ... EHOSTUNREACH


class ProgressLoop:
    def __init__(
        self,
        native: Any,
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
        self.jobs: dict[int, Job] = {}
        self.pending: dict[int, collections.deque[Job]] = {}
        self._num_queued = 0
        self._commands: collections.deque[tuple[Callable[[], Any], Future[Any]]] = (
            collections.deque()
        )
        self._lock = threading.Condition()
        # The engine's registered regions by id (shared; removed from only here, under
        # `_lock`), the jobs using each, and those deregistered while some job still did.
        self.regions = regions
        self._region_jobs: collections.Counter[int] = collections.Counter()
        self._closing_regions: dict[int, MemoryRegionHandle] = {}
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
            finish=self._finish,
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
            finish=self._finish,
            provider_name=provider_name,
            starved=self.starved,
        )
        self._max_queued = max_queued_submits
        self._spin_us = spin_us
        self._idle_spin_s = idle_spin_us / 1e6
        self._idle_wait_us = idle_wait_us
        self._inflight = 0
        self._stopping = False
        self._stopped = False
        self._sleeping = False
        # Held by a wake (from any thread) against `detach_native` freeing the engine under it.
        self._native_lock = threading.Lock()
        # Per submitting thread: inside `wakes_deferred`, and whether a wake is owed at its end.
        self._local = threading.local()
        self._next_job_id = 1
        self._finish_lock = threading.Lock()
        # Start of the post/poll call in progress (0.0: none) and the peer it posts to, for the
        # watchdog (`native_call`): the peer is stored before the start, the start cleared after.
        self._native_since = 0.0
        self._native_peer: PeerHandle | None = None
        self._wedged = ""
        self._watchdog = Watchdog(
            name=f"{name}-watchdog", probe=self.native_call, on_stall=self._abandon
        )
        self._rows = [ffi.new("uint64_t[]", _POLL_ROWS) for _ in range(4)]
        self._error = ffi.new("pd_error_t *")
        self._rc = ffi.new("int *")
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
                if self.regions.get(id(job.region)) is not job.region:
                    raise RegistrationError("memory region handle was deregistered")
                self._region_jobs[id(job.region)] += 1
            self._deadlines.admit(job)  # before the insert: keeps `jobs` deadline-ordered
            self.jobs[job.job_id] = job
            self.pending.setdefault(job.peer.fi_addr, collections.deque()).append(job)
            self._num_queued += 1
        self._wake(deferrable=True)

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
        self._wake()
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
        self._wake()

    def detach_native(self) -> None:
        """The engine is about to free the native endpoint: later wakes do nothing."""
        with self._native_lock:
            self.native = None

    def release_region(self, handle: MemoryRegionHandle) -> None:
        """Deregister ``handle`` (progress thread): new jobs from it are refused, and its
        registration is closed now, or when the last job writing from it is forgotten."""
        key = id(handle)
        with self._lock:  # `enqueue` checks and counts regions under it
            if self.regions.get(key) is not handle:
                return
            del self.regions[key]
            if self._region_jobs[key]:
                self._closing_regions[key] = handle
                return
        _close_region(handle)

    def closing_regions(self) -> list[MemoryRegionHandle]:
        """Regions deregistered while jobs still used them, not closed yet (engine teardown)."""
        with self._lock:
            handles = list(self._closing_regions.values())
            self._closing_regions.clear()
        return handles

    @contextlib.contextmanager
    def wakes_deferred(self) -> Iterator[None]:
        """Submissions (`enqueue`) by this thread inside the block wake the thread once, at its
        end; `call` and `stop` still wake it at once (they wait for it or must not wait)."""
        local = self._local
        outer = getattr(local, "deferring", False)
        local.deferring = True
        try:
            yield
        finally:
            local.deferring = outer
            if not outer and getattr(local, "wake_due", False):
                local.wake_due = False
                self._wake()

    def _wake(self, deferrable: bool = False) -> None:
        if deferrable and getattr(self._local, "deferring", False):
            self._local.wake_due = True
            return
        if self._sleeping:
            with self._native_lock:
                if self.native is not None:  # else released: nothing left to wake
                    lib.pd_wake(self.native)

    # -- the progress thread ----------------------------------------------------------------

    def _run(self) -> None:
        last_activity = time.monotonic()
        next_check = last_activity + SWEEP_PERIOD_S
        try:
            while not self._stopping:
                self._run_commands()
                posted = self._post_pending()
                spin, wait = self._spin_us, 0
                # Stranded ops may never complete: polling (in the waits too) still frees
                # their contexts if they do, but they are no reason to spin a core.
                live = self._inflight - self.stats.ops_stranded
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
                    self._sleeping = True
                    if self.pending or self._commands or self._stopping:
                        self._sleeping = False
                        continue
                if wait:
                    self.stats.sleeps += 1
                try:
                    if self._poll(spin, wait):
                        last_activity = time.monotonic()
                finally:
                    self._sleeping = False  # a raise must not leave later wakes signalling
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
                self._forget_if_idle(job)
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
                f"no free operation slot ({self._inflight} operations posted, "
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
        laddr, lens, raddr = job.arrays
        assert job.region is not None  # every write job has its source region
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
        job.posted += posted
        self._inflight += posted
        self.stats.ops_posted += posted
        if job.posted == job.total:
            return False
        rc = self._rc[0]
        if rc == -lib.FI_EAGAIN:
            self.stats.eagain_retries += 1
            return True
        self._finish(job, TransferError(f"posting a write to {job.peer.name}: {strerror(rc)}", -rc))
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
            self._finish(
                job, TransferError(f"posting a send to {job.peer.name}: {strerror(rc)}", -rc)
            )
            return False
        job.posted = 1
        self._inflight += 1
        self.stats.ops_posted += 1
        return False

    def _poll(self, spin_us: int, wait_us: int) -> bool:
        kinds, ids, data, lens = self._rows
        self._native_peer = None
        self._native_since = time.monotonic()
        n = lib.pd_poll(
            self.native, _POLL_ROWS, kinds, ids, data, lens, spin_us, wait_us, self._error
        )
        self._native_since = 0.0
        error = n <= lib.PD_POLL_ERROR
        rows = lib.PD_POLL_ERROR - n if error else n
        if rows < 0:
            raise FabricError(f"reading the completion queue failed: {strerror(rows)} ({rows})")
        imm_counts: dict[int, int] = {}
        for row in range(rows):
            kind = kinds[row]
            if kind == lib.PD_EV_LOCAL or kind == lib.PD_EV_RECV:
                if imm_counts:
                    # Callbacks follow the CQ's order: writes that landed before this row
                    # fire their counters before its callback is queued.
                    self.dispatcher.submit_all(self.counters.record(imm_counts))
                    imm_counts = {}
                if kind == lib.PD_EV_LOCAL:
                    self._complete(ids[row], lens[row])
                else:
                    self._received(ids[row], lens[row])
            else:
                imm_counts[data[row]] = imm_counts.get(data[row], 0) + lens[row]
                if kind == lib.PD_EV_IMM_RECV:
                    self.pools.repost_receive(self.native, ids[row])
        if imm_counts:
            self.dispatcher.submit_all(self.counters.record(imm_counts))
        if error:
            self._error_completion()
        return rows > 0 or error

    def _complete(self, job_id: int, count: int) -> None:
        self._inflight -= count
        self.stats.ops_completed += count
        job = self.jobs.get(job_id)
        if job is None:
            return
        job.completed += count
        if job.stranded:
            self.stats.ops_stranded -= count
        if job.completed < job.total:
            self._forget_if_idle(job)
            return
        if job.kind == SEND:
            self.stats.messages_sent += 1
        else:
            self.stats.bytes_written += job.byte_count
        self._finish(job, None)

    def _received(self, slot_id: int, length: int) -> None:
        if self.pools.deliver(self.native, slot_id, length, self.dispatcher):
            self.stats.messages_received += 1
        else:
            self.stats.messages_malformed += 1

    def _error_completion(self) -> None:
        error = self._error
        self.stats.error_completions += 1
        text = ffi.string(error.msg).decode(errors="replace")
        job = self.jobs.get(error.id)
        if job is None:
            if self.pools.is_receive(error.id):
                self.pools.repost_receive(self.native, error.id)
            log.warning("error completion without a live operation: %s (err %d)", text, error.err)
            return
        self._inflight -= 1
        job.completed += 1
        if job.stranded:
            self.stats.ops_stranded -= 1
        what = "write" if job.kind == WRITE else "message"
        exc: FabricError = TransferError(
            f"{what} to {job.peer.name} failed: {text} "
            f"(err {error.err}: {strerror(error.err)}, provider errno {error.prov_errno})",
            error.err,
            error.prov_errno,
        )
        # rxm/tcp reports a dropped connection as FI_ECANCELED with the socket errno as the
        # provider errno; either side naming a connection error means the peer is gone.
        if error.err in _CONNECTION_ERRORS or abs(error.prov_errno) in _CONNECTION_ERRORS:
            self.peers.fail(job.peer, PeerFailedError(str(exc)))
        self._finish(job, exc)

    def _claim(self, job: Job) -> bool:
        """True for exactly one caller per job: the one that delivers its outcome."""
        with self._finish_lock:
            if job.finished:
                return False
            job.finished = True
            return True

    def _deliver(self, job: Job, error: FabricError | None, *, exact: bool = True) -> None:
        """Queue the job's outcome. A failed write job first reports the ops it never posted
        (``on_unposted``): a peer failed, a deadline passed or the engine closed while they
        waited in its queue. ``exact``: False where another thread may be posting right now
        (the watchdog), so the number is not known and nothing is reported as unposted."""
        if error is None:
            if job.on_done is not None:
                self.dispatcher.submit(job.on_done)
            return
        if exact and job.on_unposted is not None and job.kind == WRITE and job.posted < job.total:
            lens = job.arrays[1]
            num_bytes = sum(int(lens[i]) for i in range(job.posted, job.total))
            self.dispatcher.submit(job.on_unposted, job.total - job.posted, num_bytes, error)
        if job.on_error is not None:
            self.dispatcher.submit(job.on_error, error)
        else:
            log.warning("unhandled fabric error: %s", error)

    def _finish(self, job: Job, error: FabricError | None) -> None:
        """Deliver the job's one outcome; forget it once no op of it is posted."""
        if self._claim(job):
            if job.send_slot >= 0 and job.completed == job.posted:
                self.pools.release_send_slot(job.send_slot)
                job.send_slot = -1
            self._deliver(job, error)
        self._forget_if_idle(job)

    def _forget_if_idle(self, job: Job) -> None:
        if job.finished and job.completed >= job.posted and job.job_id in self.jobs:
            del self.jobs[job.job_id]
            if job.send_slot >= 0:
                self.pools.release_send_slot(job.send_slot)
                job.send_slot = -1
            if job.region is not None:
                self._region_job_ended(id(job.region))
            self.peers.job_forgotten(job.peer.fi_addr)

    def _region_job_ended(self, key: int) -> None:
        """A job writing from region ``key`` is forgotten: close the region if it was
        deregistered and this was its last job."""
        with self._lock:
            self._region_jobs[key] -= 1
            if self._region_jobs[key]:
                return
            del self._region_jobs[key]
            handle = self._closing_regions.pop(key, None)
        if handle is not None:
            _close_region(handle)

    # -- ending: abandoned by the watchdog, or shut down --------------------------------------

    def _abandon(self, peer: PeerHandle | None, stalled_s: float) -> None:
        """The progress thread is stuck in the provider (`Watchdog`'s `on_stall`, on its
        thread): end everything it owes, refuse more."""
        call = f"posting to peer {peer.name}" if peer is not None else "polling the CQ"
        reason = (
            f"fabric progress thread stuck in {self.provider_name} ({call} has not returned "
            f"for {stalled_s:.1f} s); engine abandoned"
        )
        # Not proof that the peer's process is gone (`PeerStuckError`): it may only be stopped.
        stuck = None if peer is None else (peer.fi_addr, PeerStuckError(f"{peer.name}: {reason}"))
        with self._lock:
            if self._wedged or self._stopped:
                return
            self._wedged = reason
            self._stopping = True
            if stuck is not None:
                self.peers.record_failure(*stuck)
            commands = list(self._commands)
            self._commands.clear()
            jobs = list(self.jobs.values())
            self._lock.notify_all()
        log.error("%s", reason)
        for _function, future in commands:
            future.set_exception(EngineClosedError(reason))
        for job in jobs:
            if self._claim(job):  # send slots stay with the stuck thread
                # The stuck thread may be posting this job's ops: their count is not known.
                if stuck is not None and job.peer.fi_addr == stuck[0]:
                    self._deliver(job, stuck[1], exact=False)
                else:
                    self._deliver(job, EngineClosedError(reason), exact=False)
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
                self._finish(job, closed)
            fires: list[Fire] = self.counters.fail_all(EngineClosedError("engine closed"))
            self.dispatcher.submit_all(fires)
            self.peers.close_watches()
            # Whatever the watchdog delivers is queued before the caller closes the dispatcher.
            self._watchdog.stop()
            self._stopped = True
        finally:
            # Even after a raise above: else every `close` would wait for a thread that ended.
            self._end_work()


def _close_region(handle: MemoryRegionHandle) -> None:
    rc = lib.pd_mr_close(handle.mr)
    if rc != 0:
        log.error("fi_close of a memory region: %s (%d)", strerror(rc), rc)
