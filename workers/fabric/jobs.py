"""What the progress loop works on: one submission (`Job`) and the loop's counters.

Plain data, kept apart from the loop because several modules share it: the engine builds jobs,
the progress loop posts and completes them, the peer table and the deadline sweep end them,
and each counts into `ProgressStats`. It imports none of them, so none has to import another
only for a type. A job's life cycle is written at the top of `workers.fabric.progress`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.fabric.errors import FabricError
from workers.fabric.handles import MemoryRegionHandle, PeerHandle

if TYPE_CHECKING:
    from workers.fabric._fabric_cffi import IntPointer

ErrorCallback = Callable[[FabricError], None]
# (writes of a failed write job that were never posted, their bytes, why): see `Job`.
UnpostedCallback = Callable[[int, int, FabricError], None]
WRITE, SEND = 0, 1


@dataclass(eq=False)
class Job:
    job_id: int
    kind: int
    peer: PeerHandle
    total: int
    deadline: float
    on_done: Callable[[], None] | None
    on_error: ErrorCallback | None
    # Writes: native arrays of local addresses, lengths, remote addresses (one row per op).
    arrays: tuple[IntPointer, IntPointer, IntPointer] | None = None
    # Writes: the source region (its ``desc`` is posted with them). Counted in by
    # `ProgressLoop.enqueue` and out when the job is forgotten: a deregistered region's
    # registration is closed only after its last job.
    region: MemoryRegionHandle | None = None
    key: int = 0
    imm: int | None = None
    # Sends: the framed message.
    payload: bytes = b""
    send_slot: int = -1
    posted: int = 0
    completed: int = 0
    finished: bool = False
    byte_count: int = 0
    keep_alive: object = None  # what `arrays` point into
    # Writes: called before ``on_error`` with the ops the job never posted (they cannot land),
    # when there are any and this count is exact (see `JobLedger.deliver`).
    on_unposted: UnpostedCallback | None = None
    # Finished with ops still posted that may never complete (`PeerTable.strand`).
    stranded: bool = False


@dataclass
class ProgressStats:
    ops_posted: int = 0
    ops_completed: int = 0
    bytes_written: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    # Received frames too short for their header or source address, dropped.
    messages_malformed: int = 0
    error_completions: int = 0
    timeouts: int = 0
    eagain_retries: int = 0
    # Posted ops of finished jobs that may never complete (their peer failed, or shm holds
    # their completions behind a failed peer's): in flight, but no reason to spin.
    ops_stranded: int = 0
    # Times the thread slept on the CQ (idle, or every queue refused) instead of spinning.
    sleeps: int = 0
    # The CQ wait fd stayed readable with nothing to read: idle waits are naps (`completions`).
    wait_fd_dropped: bool = False
    # Address-vector entries removed (`forget_peer`, once nothing posted to them remained).
    peers_removed: int = 0
    # Writes carrying immediate data that landed on this endpoint. The counters
    # (`EngineStats.imm`) may be shared by a rank's NICs (`workers.fabric.nics`): this is
    # the share of this one.
    imm_writes_received: int = 0
