"""Routing policies: which serving worker takes a request (`RoutingPolicy`), and which prefill
worker fills its KV (`PrefillLoad`)."""

from __future__ import annotations

import pytest

from orchestrator.router.policy import LeastOutstanding, PrefillLoad, create_policy
from tests.orchestrator.harness import record


def test_least_outstanding_picks_the_least_loaded() -> None:
    workers = [record("a"), record("b"), record("c")]
    policy = LeastOutstanding(seed=0)
    assert policy.pick(workers, {"a": 3, "b": 1, "c": 2}).worker_id == "b"
    picked = {policy.pick(workers, {}).worker_id for _ in range(50)}
    assert picked == {"a", "b", "c"}  # ties are spread
    with pytest.raises(ValueError):
        create_policy("fastest")


def test_prefill_load_picks_the_fewest_tokens_in_flight_and_releases_them() -> None:
    workers = [record("p0"), record("p1")]
    load = PrefillLoad(seed=0)
    first = load.pick(workers, 1000)[0].worker_id
    other = "p1" if first == "p0" else "p0"
    # Three short prompts together weigh less than the long one: all go to the other worker.
    assert [load.pick(workers, 100)[0].worker_id for _ in range(3)] == [other] * 3
    assert (load.tokens(first), load.tokens(other)) == (1000, 300)
    load.release(first, 1000)
    assert load.pick(workers, 50)[0].worker_id == first
    load.release(first, 50)
    for _ in range(3):
        load.release(other, 100)
    assert load.tokens("p0") == load.tokens("p1") == 0
    picked = {load.pick(workers, 0)[0].worker_id for _ in range(50)}
    assert picked == {"p0", "p1"}  # ties are spread
