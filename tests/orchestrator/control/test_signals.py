"""`pdserve serve` stops cleanly however it is signalled: SIGINT or SIGTERM to its pid, to its
process group (``kill -TERM -PGID``, what many supervisors and CI runners send) or to every one of
its processes (systemd's default ``KillMode=control-group``), and a second signal during the
drain stops it at once.

Each served test starts ``pdserve serve`` (embedded Ray, the tiny preset, one mixed worker) in a
session of its own, waits for "serving on", records every process below it (Ray's GCS, raylet
and helpers, the worker), starts a streaming request and reads its first token, then signals.
It asserts an exit within grace plus a bound, the documented exit status, "shutdown complete"
(but after a second signal), a stream that ended with a clear status, and that none of the
recorded processes still runs.

``ray job stop`` (Ray's job manager sends the driver SIGTERM, then SIGKILL after
``RAY_JOB_STOP_WAIT_TIME_S``) drains a running request of a job on a ``ray start --head``
cluster whose wait is long enough, as the README says to set it; the entry point warns when it
is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import yaml

from orchestrator.api.client import pb, pb_grpc
from orchestrator.control.launch import warn_of_job_stop_wait
from orchestrator.control.processes import Proc, descendants, end, identify, is_running
from orchestrator.control.shutdown import StopSignals, off_loop
from tests.orchestrator.control.ray_head import (
    free_port,
    head_node,
    job_status,
    ray_job,
    router_serving,
)
from tests.waiting import wait_until

# The stop must end within the router's grace plus this: the workers' own drain and stop, and
# ending Ray (a bound for a loaded machine, not a timing assertion).
STOP_BOUND_SECONDS = 90


# --- the stop signals and bounded calls, in this process -------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_is_handed_on_and_the_first_starts_the_drain(signum: int) -> None:
    seconds: list[int] = []

    async def run() -> None:
        signals = StopSignals(seconds.append)
        signals.install()
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(signals.stopping.wait(), 30)
        assert signals.first == signal.SIGTERM and not seconds
        os.kill(os.getpid(), signum)
        deadline = time.monotonic() + 30
        while not seconds and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    asyncio.run(run())  # closing the loop restores the previous handlers
    assert seconds == [signum]


def test_a_blocking_call_off_the_loop_is_given_up_after_its_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = threading.Event()

    async def run() -> tuple[object, object]:
        blocked = await off_loop(lambda: release.wait(60), 0.2, "a call that blocks")
        answered = await off_loop(lambda: 42, 30, "a call that answers")
        return blocked, answered

    try:
        with caplog.at_level(logging.WARNING):
            assert asyncio.run(run()) == (None, 42)
    finally:
        release.set()
    assert "a call that blocks did not finish within 0 s" in caplog.text

    async def failing() -> None:
        await off_loop(lambda: 1 // 0, 30, "a call that fails")

    with pytest.raises(ZeroDivisionError):
        asyncio.run(failing())


def test_processes_below_a_parent_are_found_and_ended_even_if_they_ignore_sigterm(
    tmp_path: Path,
) -> None:
    ready = tmp_path / "ignoring"
    ignoring = (
        "import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "pathlib.Path(sys.argv[1]).touch(); time.sleep(120)"
    )
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; "
            f"subprocess.Popen([sys.executable, '-c', {ignoring!r}, sys.argv[1]]); time.sleep(120)",
            str(ready),
        ]
    )
    try:
        wait_until(ready.exists, timeout=60, what="the grandchild ignoring SIGTERM")
        (child,) = descendants([parent.pid])
        me = identify(parent.pid)
        assert me is not None and is_running(me)
        # The same pid with another start time is another process: never signalled as ours.
        assert not is_running(Proc(me.pid, me.start_time + 1))
        killed = end({me, child}, grace_seconds=0.5)
        assert killed == {child}  # it ignored SIGTERM
        assert parent.wait(30) == -signal.SIGTERM
        wait_until(lambda: not is_running(child), timeout=30, what="the grandchild's end")
    finally:
        parent.kill()
        parent.wait()


@pytest.mark.parametrize(
    ("wait", "warned"), [(None, True), ("3", True), ("25", True), ("30", False)]
)
def test_a_ray_job_warns_when_its_stop_would_kill_the_drain(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    wait: str | None,
    warned: bool,
) -> None:
    """Ray's job manager sends SIGTERM, then SIGKILL after ``RAY_JOB_STOP_WAIT_TIME_S`` (3 s by
    default): fewer than grace + 15 s cut the drain short."""
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")  # what marks a Ray job's driver
    if wait is None:
        monkeypatch.delenv("RAY_JOB_STOP_WAIT_TIME_S", raising=False)
    else:
        monkeypatch.setenv("RAY_JOB_STOP_WAIT_TIME_S", wait)
    with caplog.at_level(logging.WARNING):
        warn_of_job_stop_wait(grace_seconds=15)
    assert ("set it to 30 or more" in caplog.text) is warned
    caplog.clear()
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR")  # not a Ray job: nothing to say
    with caplog.at_level(logging.WARNING):
        warn_of_job_stop_wait(grace_seconds=15)
    assert not caplog.text


# --- pdserve serve, signalled -----------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None


def _tree(root: int) -> dict[int, str]:
    """pid → start time of every running process below ``root`` (read here, independently of
    the code under test)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) and fields[0] != "Z":
            parents[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return {pid: fields[19] for pid in found if (fields := _stat(pid))}


def _still_running(recorded: dict[int, str]) -> dict[int, str]:
    out = {}
    for pid, start in recorded.items():
        fields = _stat(pid)
        if fields and fields[0] not in ("Z", "X") and fields[19] == start:
            out[pid] = Path(f"/proc/{pid}/comm").read_text().strip()
    return out


@dataclass
class Served:
    process: subprocess.Popen[bytes]
    log: Path
    address: str
    grace: float
    recorded: dict[int, str] = field(default_factory=dict)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def record(self) -> None:
        self.recorded.update(_tree(self.process.pid))


@pytest.fixture
def serve(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Callable[[float], Served]]:
    """Starts ``pdserve serve`` with ``grace`` in a session of its own; kills what is left."""
    started: list[Served] = []

    def start(grace: float) -> Served:
        config = tmp_path / "cluster.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "model": str(tiny_model_dir),
                    "dtype": "float32",
                    "limits": {
                        "max_model_len": 2048,
                        "num_pages": 160,
                        "max_num_batched_tokens": 256,
                    },
                    "groups": {"mixed": {"replicas": 1, "resources_per_rank": {"cpu": 0.5}}},
                    "router": {"address": "127.0.0.1:0", "grace_seconds": grace},
                }
            )
        )
        log = tmp_path / "serve.log"
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        with log.open("wb") as out:
            process = subprocess.Popen(
                [
                    *(sys.executable, "-m", "orchestrator.cli.main", "serve", str(config)),
                    *("--http-address", "none", "--worker-metrics-port", "-1"),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        served = Served(process, log, "", grace)
        started.append(served)

        def serving() -> bool:
            if process.poll() is not None:
                pytest.fail(f"pdserve serve ended early:\n{served.text()}")
            return "serving on" in served.text()

        wait_until(serving, timeout=180, what="pdserve serve")
        match = re.search(r"serving on (\S+)", served.text())
        assert match is not None
        served.address = match.group(1)
        served.record()
        return served

    yield start
    for served in started:
        if served.process.poll() is None:
            os.killpg(served.process.pid, signal.SIGKILL)
            served.process.wait()
        for pid in _still_running(served.recorded):
            os.kill(pid, signal.SIGKILL)


@dataclass
class Stream:
    """A streaming request read on a thread of its own: its last response or its error."""

    first: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    finish_reason: str = ""
    error: grpc.RpcError | None = None


def start_stream(address: str, max_tokens: int) -> Stream:
    stream = Stream()

    def read() -> None:
        with grpc.insecure_channel(address) as channel:
            request = pb.GenerateRequest(
                prompt="hello",
                sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            )
            try:
                for response in pb_grpc.GenerationStub(channel).Generate(request, timeout=300):
                    stream.first.set()
                    stream.finish_reason = response.finish_reason or stream.finish_reason
            except grpc.RpcError as error:
                stream.error = error
            finally:
                stream.first.set()
                stream.done.set()

    threading.Thread(target=read, daemon=True).start()
    assert stream.first.wait(120), "no first token"
    assert not stream.done.is_set(), "the request ended before the signal: make it longer"
    return stream


def assert_ended_clearly(stream: Stream) -> None:
    """Completed, or an error status with a message: never a hang."""
    assert stream.done.wait(60), "the stream did not end"
    if stream.error is None:
        assert stream.finish_reason in ("length", "stop", "abort")
    else:
        assert stream.error.code() in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.CANCELLED,
            grpc.StatusCode.ABORTED,
        ), stream.error
        assert stream.error.details(), stream.error


def assert_nothing_left(served: Served) -> None:
    assert served.recorded, "no process was recorded below pdserve"
    wait_until(
        lambda: not _still_running(served.recorded),
        timeout=30,
        what=f"the end of {_still_running(served.recorded)}",
    )


def _sessions(served: Served) -> dict[str, int]:
    out = {}
    for pid in served.recorded:
        fields = _stat(pid)
        if fields:
            out[Path(f"/proc/{pid}/comm").read_text().strip()] = int(fields[3])
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "to_group"),
    [(signal.SIGTERM, False), (signal.SIGTERM, True), (signal.SIGINT, True)],
    ids=["sigterm-pid", "sigterm-group", "sigint-group"],
)
def test_a_signal_to_the_pid_or_its_group_drains_the_running_request(
    serve: Callable[[float], Served], signum: int, to_group: bool
) -> None:
    served: Served = serve(10.0)
    # Ray's processes lead sessions of their own: a signal to pdserve's group misses them.
    sessions = _sessions(served)
    assert sessions["gcs_server"] != served.process.pid, sessions
    assert sessions["raylet"] != served.process.pid, sessions
    stream = start_stream(served.address, max_tokens=300)
    served.record()
    if to_group:
        os.killpg(served.process.pid, signum)
    else:
        os.kill(served.process.pid, signum)
    assert served.process.wait(served.grace + STOP_BOUND_SECONDS) == 0, served.text()
    log = served.text()
    assert "signal received: draining" in log and "shutdown complete" in log, log
    assert "Ray is gone" not in log, log
    assert stream.done.wait(60) and stream.error is None, stream.error
    assert stream.finish_reason == "length"  # drained: it ran to its end
    assert_nothing_left(served)


@pytest.mark.slow
def test_sigterm_to_every_process_at_once_ends_cleanly_without_ray(
    serve: Callable[[float], Served],
) -> None:
    """What systemd's ``KillMode=control-group`` does, simulated by signalling every process of
    the tree (pdserve, Ray's GCS, raylet and helpers, the worker) at once: Ray is gone when the
    drain asks it, and pdserve ends what is left of it by pid instead of waiting for it."""
    served: Served = serve(10.0)
    stream = start_stream(served.address, max_tokens=1500)
    served.record()
    for pid in [served.process.pid, *served.recorded]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    assert served.process.wait(served.grace + STOP_BOUND_SECONDS) == 0, served.text()
    log = served.text()
    assert "shutdown complete" in log, log
    assert_ended_clearly(stream)
    assert_nothing_left(served)


@pytest.mark.slow
def test_a_second_signal_during_the_drain_stops_at_once(serve: Callable[[float], Served]) -> None:
    served: Served = serve(120.0)
    stream = start_stream(served.address, max_tokens=1900)  # keeps the drain busy
    served.record()
    os.killpg(served.process.pid, signal.SIGTERM)
    wait_until(lambda: "signal received: draining" in served.text(), timeout=60, what="drain")
    os.killpg(served.process.pid, signal.SIGTERM)
    # Far below the 120 s grace: the drain was not waited for.
    assert served.process.wait(STOP_BOUND_SECONDS) == 128 + signal.SIGTERM, served.text()
    log = served.text()
    assert "second signal (SIGTERM) while draining: stopping now" in log, log
    assert "shutdown complete" not in log, log
    assert_ended_clearly(stream)
    assert_nothing_left(served)


@pytest.fixture
def ray_head(tmp_path: Path) -> Iterator[str]:
    """A head node that waits 30 s between ``ray job stop``'s SIGTERM and its SIGKILL."""
    with head_node(tmp_path, RAY_JOB_STOP_WAIT_TIME_S="30") as address:
        yield address


@pytest.mark.slow
def test_ray_job_stop_drains_the_running_request(
    ray_head: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    router = f"127.0.0.1:{free_port()}"
    working_dir = tmp_path / "job"  # the config alone, as the README's `--working-dir configs`
    working_dir.mkdir()
    (working_dir / "cluster.yaml").write_text(
        yaml.safe_dump(
            {
                "model": "unused",  # --model names the checkpoint
                "dtype": "float32",
                "limits": {"max_model_len": 2048, "num_pages": 160, "max_num_batched_tokens": 256},
                "groups": {"mixed": {"replicas": 1, "resources_per_rank": {"cpu": 0.5}}},
                "router": {"address": router, "http_address": None, "grace_seconds": 10},
            }
        )
    )
    job_id = f"pdserve-signals-{free_port()}"
    ray_job(
        ray_head,
        *("submit", "--no-wait", f"--submission-id={job_id}", f"--working-dir={working_dir}"),
        *("--", sys.executable, "-m", "orchestrator.control.launch", "cluster.yaml"),
        *("--model", str(tiny_model_dir), "--worker-metrics-port", "-1"),
    )

    def serving() -> bool:
        if job_status(ray_head, job_id) in ("FAILED", "STOPPED", "SUCCEEDED"):
            pytest.fail(f"the job ended early:\n{ray_job(ray_head, 'logs', job_id)}")
        return router_serving(router)

    wait_until(serving, timeout=180, what="the job's router")
    logs = ray_job(ray_head, "logs", job_id)
    worker = re.search(r"mixed-0 started \(pid (\d+)\)", logs)
    assert worker is not None, logs
    worker_proc = identify(int(worker.group(1)))  # the head runs on this machine
    assert worker_proc is not None
    stream = start_stream(router, max_tokens=300)
    ray_job(ray_head, "stop", job_id)  # waits for the job to end
    assert job_status(ray_head, job_id) == "STOPPED"
    logs = ray_job(ray_head, "logs", job_id)
    assert "signal received: draining" in logs and "shutdown complete" in logs, logs
    assert "ray job stop kills this driver" not in logs, logs  # 30 s: enough for grace 10
    assert stream.done.wait(60) and stream.error is None, stream.error
    assert stream.finish_reason == "length"  # drained: it ran to its end
    wait_until(lambda: not is_running(worker_proc), timeout=60, what="the worker's end")
