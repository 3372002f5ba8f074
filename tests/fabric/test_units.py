"""Pure-Python pieces: page runs, descriptors, counter semantics (no fabric traffic)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest

from workers.fabric import (
    DescriptorError,
    ImmError,
    ImmTimeoutError,
    MemoryRegionDescriptor,
    can_coalesce,
    coalesce_page_runs,
    count_paged_write_runs,
    query_fabric,
    select_nics,
)
from workers.fabric.callbacks import CallbackDispatcher, Inline
from workers.fabric.counters import ImmCounters
from workers.fabric.errors import EngineClosedError, FabricError
from workers.fabric.providers import FabricInfo


def test_page_runs() -> None:
    runs = coalesce_page_runs([0, 1, 2, 7, 8, 3], [10, 11, 12, 5, 6, 13])
    assert runs.tolist() == [[0, 10, 3], [7, 5, 2], [3, 13, 1]]
    assert count_paged_write_runs([0, 1, 2], [4, 5, 7]) == 2
    assert count_paged_write_runs([0, 1, 2], [4, 5, 6], coalesce=False) == 3
    assert count_paged_write_runs(list(range(10)), list(range(10)), max_pages_per_run=4) == 3
    assert count_paged_write_runs([], []) == 0
    assert can_coalesce(4096, None, 4096) and not can_coalesce(1024, 4096, None)
    with pytest.raises(ValueError):
        count_paged_write_runs([0, 1], [0])
    with pytest.raises(ValueError):
        count_paged_write_runs([-1], [0])


def test_descriptor_roundtrip_and_validation() -> None:
    descriptor = MemoryRegionDescriptor("tcp;ofi_rxm", 0, 1 << 20, 42, False)
    data = descriptor.to_bytes()
    assert len(data) == 32 + len("tcp;ofi_rxm")
    assert MemoryRegionDescriptor.from_bytes(data) == descriptor
    shm = MemoryRegionDescriptor("shm", 0x7F0000001000, 4096, 3, True)
    assert MemoryRegionDescriptor.from_bytes(shm.to_bytes()).remote_address(8) == 0x7F0000001008
    bad = [
        data[:20],
        b"XXXX" + data[4:],
        data[:4] + bytes([9]) + data[5:],
        data + b"x",
        data[:-1],
    ]
    for raw in bad:
        with pytest.raises(DescriptorError):
            MemoryRegionDescriptor.from_bytes(raw)
    with pytest.raises(DescriptorError):
        MemoryRegionDescriptor("tcp;ofi_rxm", 0, 0, 1, False)
    with pytest.raises(DescriptorError):
        MemoryRegionDescriptor("tcp;ofi_rxm", 5, 10, 1, False)


def _run(fires: list) -> list:  # type: ignore[type-arg]
    return [callback(*args) for callback, args in fires]


def test_counter_semantics() -> None:
    counters = ImmCounters(max_unexpected=2, max_cancelled=2)
    hits: list[str] = []
    assert counters.expect(1, 3, lambda: hits.append("one")) == []
    assert counters.record({1: 2}) == []
    _run(counters.record({1: 2}))  # surplus of 1 stays buffered
    assert hits == ["one"]
    _run(counters.expect(1, 1, lambda: hits.append("one-again")))
    assert hits == ["one", "one-again"]
    with pytest.raises(ImmError):
        counters.expect(2, 0, lambda: None)
    counters.expect(2, 1, lambda: None)
    with pytest.raises(ImmError):
        counters.expect(2, 1, lambda: None)
    assert counters.cancel(2)
    assert counters.record({2: 4}) == []
    assert counters.stats().late_dropped == 4
    counters.record({10: 1, 11: 1, 12: 1})  # third value evicts the oldest buffered
    assert counters.stats().overflow_dropped == 1
    errors: list[BaseException] = []
    counters.expect(3, 1, lambda: None, errors.append, deadline=0.0)
    _run(counters.expire(1.0))
    assert isinstance(errors[0], ImmTimeoutError)
    counters.expect(4, 1, lambda: None, errors.append)
    _run(counters.fail_all(EngineClosedError("closed")))
    assert isinstance(errors[1], EngineClosedError)


def test_counter_is_thread_safe() -> None:
    counters = ImmCounters()
    fired = threading.Semaphore(0)
    for imm in range(100):
        counters.expect(imm, 40, fired.release)

    def feed() -> None:
        for _ in range(10):
            _run(counters.record({imm: 1 for imm in range(100)}))

    threads = [threading.Thread(target=feed) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert counters.stats().fired == 100


def test_query_and_nic_selection() -> None:
    infos = query_fabric("tcp;ofi_rxm", "127.0.0.1")
    assert infos and infos[0].provider == "tcp;ofi_rxm" and infos[0].imm_bits >= 32
    base = infos[0]

    def nic(name: str, pci: str, numa: int, speed: int) -> FabricInfo:
        fields = {**base.__dict__, "domain": name, "pci_address": pci, "numa_node": numa}
        return FabricInfo(**{**fields, "link_speed": speed})

    nics = [
        nic("mlx5_0", "0000:17:00.0", 0, 100),
        nic("mlx5_1", "0000:b1:00.0", 1, 200),
        nic("mlx5_2", "0000:ca:00.0", 1, 200),
    ]
    assert [n.domain for n in select_nics(nics, numa_node=1, near_pci="0000:c8:00.0", count=2)] == [
        "mlx5_2",
        "mlx5_1",
    ]
    assert select_nics(nics, numa_node=0)[0].domain == "mlx5_0"
    assert select_nics(nics)[0].link_speed == 200
    assert np.all(np.array([n.imm_bits for n in nics]) == base.imm_bits)


def test_inline_reached_callbacks_run_where_the_count_completes() -> None:
    counters = ImmCounters()
    dispatcher = CallbackDispatcher("test-callbacks")
    where: list[str] = []
    queued = threading.Event()

    def record(label: str) -> Callable[[], None]:
        return lambda: where.append(f"{label} on {threading.current_thread().name}")

    here = threading.current_thread().name
    assert counters.expect(1, 2, Inline(record("inline"))) == []

    def on_queue() -> None:
        record("queued")()
        queued.set()

    counters.expect(2, 1, on_queue)
    dispatcher.submit_all(counters.record({1: 2, 2: 1}))
    assert where[0] == f"inline on {here}"  # ran while being handed over
    assert queued.wait(5) and where[1] == "queued on test-callbacks"
    # Buffered arrivals complete it at arming: it runs on the arming thread.
    counters.record({3: 1})
    dispatcher.submit_all(counters.expect(3, 1, Inline(record("at arming"))))
    assert where[-1] == f"at arming on {here}"
    # A raising inline callback is logged and counted, never raised into the caller.
    counters.expect(4, 1, Inline(lambda: 1 / 0))  # type: ignore[arg-type]
    dispatcher.submit_all(counters.record({4: 1}))
    assert dispatcher.errors == 1
    dispatcher.close(5)


def test_counters_refuse_arming_once_failed_all() -> None:
    """Once the engine's counters were failed (closed, abandoned), arming one raises: nothing
    would fire or expire it."""
    counters = ImmCounters()
    errors: list[FabricError] = []
    assert counters.expect(1, 1, lambda: None, errors.append) == []
    fires = counters.fail_all(EngineClosedError("engine closed"))
    assert len(fires) == 1 and isinstance(fires[0][1][0], EngineClosedError)
    with pytest.raises(EngineClosedError, match="engine closed"):
        counters.expect(2, 1, lambda: None, errors.append)
