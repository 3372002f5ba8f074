from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.fabric.fakes import BindingLog
from tests.fabric.harness import RemoteTarget, close_engine
from workers.fabric import TransferEngine
from workers.fabric._lib import lib

PROVIDERS = ["tcp;ofi_rxm", "shm"]


@pytest.fixture(params=PROVIDERS)
def provider(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_engine(provider: str) -> Iterator[Callable[..., TransferEngine]]:
    """Engines for this test; every one is closed (and its threads checked) at teardown."""
    engines: list[TransferEngine] = []

    def make(**options: Any) -> TransferEngine:
        engine = TransferEngine(provider, **options)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        close_engine(engine)


@pytest.fixture
def make_target(provider: str) -> Iterator[Callable[[int], RemoteTarget]]:
    """Spawned target processes; each must exit 0 (clean close, no live threads)."""
    targets: list[RemoteTarget] = []

    def make(num_bytes: int) -> RemoteTarget:
        target = RemoteTarget(provider, num_bytes)
        targets.append(target)
        return target

    yield make
    codes = [(target.close(), target.killed) for target in targets]
    assert all(code == 0 or killed for code, killed in codes), f"child exit codes {codes}"


@pytest.fixture
def binding_log(monkeypatch: pytest.MonkeyPatch) -> BindingLog:
    """The spy `BindingLog` in place of the binding, for this test."""
    spy = BindingLog(lib)
    spy.install(monkeypatch)
    return spy
