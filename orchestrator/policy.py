"""Routing policies: which decode (or mixed) worker takes a request, and which prefill worker
fills its KV.

Contract of `RoutingPolicy.pick`: given the ready workers with room (never empty) and the
router's count of outstanding requests per worker id, return one of them. Policies keep no
references to records between calls. ``create_policy(name)`` is the registry of names
(`orchestrator.config_sections.ROUTING_POLICIES`).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

from orchestrator.registry import WorkerRecord


class RoutingPolicy(ABC):
    @abstractmethod
    def pick(
        self, workers: Sequence[WorkerRecord], outstanding: Mapping[str, int]
    ) -> WorkerRecord: ...


class LeastOutstanding(RoutingPolicy):
    """Fewest requests in flight from this router; ties broken at random so that equal workers
    share the load instead of the first one taking every burst."""

    def __init__(self, seed: int | None = None) -> None:
        self._random = random.Random(seed)

    def pick(self, workers: Sequence[WorkerRecord], outstanding: Mapping[str, int]) -> WorkerRecord:
        least = min(outstanding.get(w.worker_id, 0) for w in workers)
        tied = [w for w in workers if outstanding.get(w.worker_id, 0) == least]
        return self._random.choice(tied)


class RoundRobin(RoutingPolicy):
    def __init__(self, seed: int | None = None) -> None:
        self._next = 0

    def pick(self, workers: Sequence[WorkerRecord], outstanding: Mapping[str, int]) -> WorkerRecord:
        ordered = sorted(workers, key=lambda w: w.worker_id)
        worker = ordered[self._next % len(ordered)]
        self._next += 1
        return worker


class RandomChoice(RoutingPolicy):
    def __init__(self, seed: int | None = None) -> None:
        self._random = random.Random(seed)

    def pick(self, workers: Sequence[WorkerRecord], outstanding: Mapping[str, int]) -> WorkerRecord:
        return self._random.choice(list(workers))


_POLICIES: dict[str, type[RoutingPolicy]] = {
    "least_outstanding": LeastOutstanding,
    "round_robin": RoundRobin,
    "random": RandomChoice,
}


def create_policy(name: str, seed: int | None = None) -> RoutingPolicy:
    try:
        return _POLICIES[name](seed)  # type: ignore[call-arg]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(_POLICIES)}") from None


def pick_prefill_source(
    prefill_workers: Sequence[WorkerRecord], rng: random.Random
) -> WorkerRecord:
    """The source replica set of one request: a uniformly random ready prefill worker, so that
    every source (and its NICs) initiates writes (DESIGN.md §4: each destination replica set is
    mapped at random onto a source replica set)."""
    return rng.choice(list(prefill_workers))
