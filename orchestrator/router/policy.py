"""Routing policies: which decode (or mixed) worker takes a request, and which prefill worker
fills its KV (`PrefillLoad`).

Contract of `RoutingPolicy.pick`: given the ready workers with room (never empty), the
router's count of outstanding requests per worker id and the request's prompt pages
(`orchestrator.router.prefix_index`; only ``kv_aware`` reads them), return one of them. Policies
keep no references to records between calls. ``create_policy(name)`` is the registry of names
(`orchestrator.config.sections.ROUTING_POLICIES`).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from orchestrator.control.registry import WorkerRecord
from orchestrator.router.prefix_index import PrefixIndex, PromptPages


class RoutingPolicy(ABC):
    # The prompt-prefix index the router keeps up to date for this policy (None: none needed).
    index: PrefixIndex | None = None

    @abstractmethod
    def pick(
        self,
        workers: Sequence[WorkerRecord],
        outstanding: Mapping[str, int],
        prompt: PromptPages | None = None,
    ) -> WorkerRecord: ...


class LeastOutstanding(RoutingPolicy):
    """Fewest requests in flight from this router; ties broken at random so that equal workers
    share the load instead of the first one taking every burst."""

    def __init__(self, seed: int | None = None) -> None:
        self._random = random.Random(seed)

    def pick(
        self,
        workers: Sequence[WorkerRecord],
        outstanding: Mapping[str, int],
        prompt: PromptPages | None = None,
    ) -> WorkerRecord:
        least = min(outstanding.get(w.worker_id, 0) for w in workers)
        tied = [w for w in workers if outstanding.get(w.worker_id, 0) == least]
        return self._random.choice(tied)


class RoundRobin(RoutingPolicy):
    def __init__(self, seed: int | None = None) -> None:
        self._next = 0

    def pick(
        self,
        workers: Sequence[WorkerRecord],
        outstanding: Mapping[str, int],
        prompt: PromptPages | None = None,
    ) -> WorkerRecord:
        ordered = sorted(workers, key=lambda w: w.worker_id)
        worker = ordered[self._next % len(ordered)]
        self._next += 1
        return worker


class RandomChoice(RoutingPolicy):
    def __init__(self, seed: int | None = None) -> None:
        self._random = random.Random(seed)

    def pick(
        self,
        workers: Sequence[WorkerRecord],
        outstanding: Mapping[str, int],
        prompt: PromptPages | None = None,
    ) -> WorkerRecord:
        return self._random.choice(list(workers))


@dataclass(frozen=True)
class KVAwareWeights:
    """``kv_aware``'s score of a worker: ``cache * (share of the prompt's blocks it holds) -
    load * (its outstanding requests / capacity)``; the highest wins. With the defaults a
    worker holding a whole conversation keeps it until it carries a full worker's load more
    than another."""

    cache: float = 1.0
    load: float = 1.0
    capacity: int = 64  # requests in flight per worker (the router's queueing bound)
    max_blocks_per_worker: int = 1 << 16


class KVAware(RoutingPolicy):
    """The worker whose prefix cache (as `PrefixIndex` estimates it) holds most of the prompt,
    weighed against its load (`KVAwareWeights`); ties go to the least loaded, then at random.
    Without an estimate for any worker (a new prompt, a fresh router) it is least-outstanding."""

    def __init__(self, seed: int | None = None, weights: KVAwareWeights | None = None) -> None:
        self.weights = weights or KVAwareWeights()
        self.prefixes = PrefixIndex(self.weights.max_blocks_per_worker)
        self.index = self.prefixes
        self._random = random.Random(seed)

    def pick(
        self,
        workers: Sequence[WorkerRecord],
        outstanding: Mapping[str, int],
        prompt: PromptPages | None = None,
    ) -> WorkerRecord:
        weights = self.weights

        def score(worker: WorkerRecord) -> tuple[float, int]:
            load = outstanding.get(worker.worker_id, 0)
            hit = self.prefixes.share(worker, prompt) if prompt is not None else 0.0
            return round(weights.cache * hit - weights.load * load / weights.capacity, 9), -load

        scores = {worker.worker_id: score(worker) for worker in workers}
        best = max(scores.values())
        return self._random.choice([w for w in workers if scores[w.worker_id] == best])


_POLICIES: dict[str, type[RoutingPolicy]] = {
    "least_outstanding": LeastOutstanding,
    "round_robin": RoundRobin,
    "random": RandomChoice,
    "kv_aware": KVAware,
}


def create_policy(
    name: str, seed: int | None = None, weights: KVAwareWeights | None = None
) -> RoutingPolicy:
    """``weights``: ``kv_aware``'s (ignored by the others)."""
    if name == "kv_aware":
        return KVAware(seed, weights)
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

    def pick(
        self,
        workers: Sequence[WorkerRecord],
        num_tokens: int,
        cached_tokens: Callable[[WorkerRecord], int] | None = None,
    ) -> tuple[WorkerRecord, int]:
        """Charge the prompt's ``num_tokens`` to the least-loaded of ``workers`` (not empty);
        returns it and the tokens charged, which the caller `release`s once the prefill is over
        (first token or end). ``cached_tokens(worker)``: the prompt's tokens that worker is
        thought to hold cached (``kv_aware``): it is charged only the rest, and the worker with
        the least work queued once this prompt is added wins."""

        def work(worker: WorkerRecord) -> int:
            cached = cached_tokens(worker) if cached_tokens is not None else 0
            return self._tokens.get(worker.worker_id, 0) + num_tokens - cached

        least = min(work(w) for w in workers)
        worker = self._random.choice([w for w in workers if work(w) == least])
        charged = least - self._tokens.get(worker.worker_id, 0)
        self._tokens[worker.worker_id] = least
        return worker, charged

    def release(self, worker_id: str, num_tokens: int) -> None:
        left = self._tokens.get(worker_id, 0) - num_tokens
        if left > 0:
            self._tokens[worker_id] = left
        else:
            self._tokens.pop(worker_id, None)

    def tokens(self, worker_id: str) -> int:
        return self._tokens.get(worker_id, 0)
