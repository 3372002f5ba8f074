"""Routing policies: which decode (or mixed) worker takes a request, and which prefill worker
fills its KV (`PrefillLoad`).

Contract of `RoutingPolicy.pick`: given the ready workers with room (never empty) and the
router's count of outstanding requests per worker id, return one of them. Policies keep no
references to records between calls. ``create_policy(name)`` is the registry of names
(`orchestrator.config.sections.ROUTING_POLICIES`).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

from orchestrator.control.registry import WorkerRecord


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


class PrefillLoad:
    """Which prefill worker fills a request's KV: the one with the fewest prompt tokens this
    router sent it whose first token has not come back yet (the prefill work queued there, as
    far as this router knows), ties broken at random.

    A uniformly random source can queue a long prompt behind another while a second prefill
    worker idles. Tokens, not requests, because the prefill cost grows with the prompt. Each
    router counts only its own requests. The simulator picks prefill instances the same way.
    The mapping of a decoder's replica sets onto the source's (docs/design.md §4) is the
    messenger's, per request, and stays random.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._random = random.Random(seed)
        self._tokens: dict[str, int] = {}

    def pick(self, workers: Sequence[WorkerRecord], num_tokens: int) -> WorkerRecord:
        """Charge ``num_tokens`` to the least-loaded of ``workers`` (not empty) and return it;
        the caller `release`s the same amount once the prefill is over (first token or end)."""
        least = min(self._tokens.get(w.worker_id, 0) for w in workers)
        tied = [w for w in workers if self._tokens.get(w.worker_id, 0) == least]
        worker = self._random.choice(tied)
        self._tokens[worker.worker_id] = least + num_tokens
        return worker

    def release(self, worker_id: str, num_tokens: int) -> None:
        left = self._tokens.get(worker_id, 0) - num_tokens
        if left > 0:
            self._tokens[worker_id] = left
        else:
            self._tokens.pop(worker_id, None)

    def tokens(self, worker_id: str) -> int:
        return self._tokens.get(worker_id, 0)
