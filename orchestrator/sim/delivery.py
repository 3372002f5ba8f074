"""A token's way out: from the engine step that sampled it to the client that counts its gap.

The simulator's inter-token gaps are its engine steps. A measured gap is the client's: each
streamed message crosses the worker's output queue, its gRPC stream, the router and the client's
own event loop, on the same cores as the engines. A delay the same for every message cancels
out of the gaps (the request overheads hold it in TTFT); its variation does not: a message held
up widens the gap before it and narrows the one after, and the p99 of the gaps grows. On the
`deepseek-tiny` preset, whose decode steps take ~3 ms, the simulated ITL p99 (the steps' tail,
7.3 ms) was a fifth short of the measured one (8.8 ms) in sample and out
(bench/history/RESULTS-notebook.md, "DeepSeek's MLA and MoE steps, served").

The model: each message's extra delay is an independent exponential draw (one parameter, its
mean, never negative); tokens sampled by one step travel in one message and share its draw; a
stream is ordered, so a message never arrives before the one ahead of it. The mean is measured
in sample by `pdserve calibrate --overheads-from` (`orchestrator.loadgen.overheads`): the value
at which the simulated ITL p99 of the measured run equals the measured one, 0 when the steps
alone already reach it.
"""

from __future__ import annotations

import numpy as np


def delivered_gaps(gaps: np.ndarray, mean_s: float, rng: np.random.Generator) -> np.ndarray:
    """The gaps a client sees between the tokens whose engine-side gaps are ``gaps`` (the gap
    before each token after the first; 0 before a token sampled by the same step as the one
    ahead of it) when each message is delayed by an exponential draw of mean ``mean_s``."""
    if mean_s < 0:
        raise ValueError(f"a token delay's mean must be >= 0, got {mean_s}")
    if mean_s == 0 or len(gaps) == 0:
        return gaps
    produced = np.concatenate(([0.0], np.cumsum(gaps)))
    new_message = np.concatenate(([True], np.asarray(gaps) > 0))
    draws = rng.exponential(mean_s, int(new_message.sum()))
    delay = draws[np.cumsum(new_message) - 1]  # each token: its message's draw
    arrived = np.maximum.accumulate(produced + delay)
    return np.diff(arrived)
