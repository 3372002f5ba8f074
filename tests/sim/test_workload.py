from __future__ import annotations

import numpy as np
import pytest

from orchestrator.sim.workload import LengthDist, Workload


def _workload(rate: float = 2.0, seed: int = 0, arrival: str = "poisson") -> Workload:
    return Workload(
        rate, 500, LengthDist.parse("chat:300:16-4096"), LengthDist.parse("uniform:10-20"),
        arrival=arrival, seed=seed,  # type: ignore[arg-type]
    )  # fmt: skip


def test_same_seed_same_requests_and_rate_only_scales_time() -> None:
    base, again, faster = _workload(), _workload(), _workload(rate=4.0)
    assert base.requests() == again.requests()
    for slow, fast in zip(base.requests(), faster.requests(), strict=True):
        assert fast.num_prompt_tokens == slow.num_prompt_tokens
        assert fast.arrival_time == pytest.approx(slow.arrival_time / 2)
    assert base.requests() != _workload(seed=1).requests()


def test_lengths_stay_in_bounds_and_chat_has_a_long_tail() -> None:
    requests = _workload().requests()
    prompts = np.array([r.num_prompt_tokens for r in requests])
    assert prompts.min() >= 16 and prompts.max() <= 4096
    assert np.mean(prompts) > np.median(prompts)  # long tail: mean above median
    assert all(10 <= r.num_output_tokens <= 20 for r in requests)


def test_arrivals_are_ordered_and_fixed_arrivals_evenly_spaced() -> None:
    times = [r.arrival_time for r in _workload().requests()]
    assert times[0] == 0 and times == sorted(times)
    assert 500 / times[-1] == pytest.approx(2.0, rel=0.15)  # Poisson mean rate
    fixed = [r.arrival_time for r in _workload(arrival="fixed").requests()]
    assert np.allclose(np.diff(fixed), 0.5)


@pytest.mark.parametrize("text", ["fixed:0", "uniform:5-2", "chat:10:20-30", "zipf:3", "fixed:x"])
def test_bad_length_distributions_are_rejected(text: str) -> None:
    with pytest.raises(ValueError):
        LengthDist.parse(text)
