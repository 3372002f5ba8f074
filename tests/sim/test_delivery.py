"""A token's way out to the client: message delays that widen and narrow the engine's gaps,
keep the stream's order and leave what a request takes from first to last token alone."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from orchestrator.sim.delivery import delivered_gaps
from orchestrator.sim.instances import EngineLimits
from orchestrator.sim.metrics import summarize
from orchestrator.sim.simulator import Layout, simulate
from orchestrator.sim.workload import LengthDist, Workload
from tests.sim.toy import affine


def test_no_delay_keeps_the_engines_gaps() -> None:
    gaps = np.array([0.01, 0.02, 0.0, 0.01])
    assert delivered_gaps(gaps, 0.0, np.random.default_rng(0)) is gaps
    with pytest.raises(ValueError, match=">= 0"):
        delivered_gaps(gaps, -1e-3, np.random.default_rng(0))


def test_delays_keep_order_and_messages_and_move_only_the_gaps() -> None:
    steps = np.full(2000, 0.004)
    steps[::5] = 0.0  # every fifth token shares its step's message with the token ahead
    out = delivered_gaps(steps, 0.001, np.random.default_rng(1))
    assert len(out) == len(steps) and out.min() >= 0  # an ordered stream: never negative
    assert np.all(out[steps == 0] == 0)  # one message, one arrival
    # A varying delay spreads the gaps around the steps; a stream's span moves by at most
    # the difference of its first and last message's delays.
    assert out.max() > steps.max() and np.percentile(out, 99) > np.percentile(steps, 99)
    assert abs(out.sum() - steps.sum()) < 0.02
    # Its mean gap is the steps' (the delay does not slow the engine down).
    assert out[steps > 0].mean() == pytest.approx(0.004, rel=0.01)


def test_the_simulator_widens_the_gaps_by_the_models_token_delay() -> None:
    workload = Workload(4.0, 60, LengthDist.parse("fixed:300"), LengthDist.parse("fixed:40"))
    limits = EngineLimits(max_num_seqs=8, max_num_batched_tokens=256)
    for layout in (Layout(num_prefill=1, num_decode=1), Layout(num_mixed=2)):
        base = simulate(affine(), layout, workload, limits)
        delayed_model = dataclasses.replace(affine(), token_delay_s=(0.002, 0.003))
        delayed = simulate(delayed_model, layout, workload, limits)
        again = simulate(delayed_model, layout, workload, limits)
        for a, b, c in zip(base.records, delayed.records, again.records, strict=True):
            # TTFT and the end are the engine's; only the gaps between are moved.
            assert (b.first_token_time, b.finish_time) == (a.first_token_time, a.finish_time)
            assert len(b.itl_gaps) == len(a.itl_gaps)
            assert np.array_equal(b.itl_gaps, c.itl_gaps)  # the same seed, the same draws
        assert summarize(delayed).itl_p99 > summarize(base).itl_p99
        assert summarize(delayed).tpot_mean == pytest.approx(summarize(base).tpot_mean)
