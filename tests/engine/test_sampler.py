"""Each sampling option checked on crafted logits."""

from __future__ import annotations

import math

import pytest
import torch

from workers.engine.errors import InvalidRequestError
from workers.engine.sampler import (
    Sampler,
    SamplingRow,
    apply_penalties,
    apply_top_k_top_p,
    argmax,
    probabilities,
)
from workers.engine.sampling_params import SamplingParams


def _row(
    params: SamplingParams,
    prompt: list[int] | None = None,
    out: list[int] | None = None,
    generator: torch.Generator | None = None,
) -> SamplingRow:
    return SamplingRow(params, prompt or [], out or [], generator)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_torchs_argmax_with_ties_and_nan(dtype: torch.dtype) -> None:
    """The faster reduction picks what ``Tensor.argmax`` picks: the first of tied maxima, and
    a NaN over any number."""
    logits = torch.randint(0, 4, (64, 49152), generator=torch.Generator().manual_seed(0))
    logits = logits.to(dtype)  # many ties per row
    logits[3, 100] = logits[3, 7] = float("nan")
    logits[5] = 1.0  # every value tied
    assert torch.equal(argmax(logits), logits.argmax(dim=-1))
    assert argmax(logits)[3] == 7 and argmax(logits)[5] == 0


def test_greedy_takes_the_argmax_per_row() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 1.0, 2.0]])
    out = Sampler()(logits, [_row(SamplingParams(temperature=0))] * 2)
    assert out.token_ids == [1, 0] and out.logprobs is None


def test_logprob_is_the_chosen_tokens_raw_log_softmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    out = Sampler()(logits, [_row(SamplingParams(temperature=0, logprobs=True))])
    expected = 3.0 - math.log(math.exp(0) + math.exp(3) + math.exp(1))
    assert out.logprobs is not None and out.logprobs[0] == pytest.approx(expected, abs=1e-6)


def test_top_k_keeps_the_k_largest() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]])
    masked = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isinf(masked[0, [0, 3]]).all() and torch.equal(
        masked[0, [1, 2]], logits[0, [1, 2]]
    )


def test_top_p_keeps_the_smallest_nucleus_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = ~torch.isinf(apply_top_k_top_p(logits, torch.tensor([4]), torch.tensor([0.8])))
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 + 0.3 reaches 0.8
    kept = ~torch.isinf(apply_top_k_top_p(logits, torch.tensor([4]), torch.tensor([0.81])))
    assert kept.tolist() == [[True, True, True, False]]


def test_min_p_drops_tokens_below_a_fraction_of_the_top() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    probs = probabilities(logits, [SamplingParams(min_p=0.4)])  # threshold 0.2
    assert (probs[0, 2:] == 0).all()
    assert probs[0, :2].tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8])


def test_temperature_scales_logits() -> None:
    logits = torch.tensor([[1.0, 2.0]])
    probs = probabilities(logits, [SamplingParams(temperature=0.5)])
    assert probs[0].tolist() == pytest.approx(torch.softmax(logits[0] / 0.5, -1).tolist())


def test_penalty_arithmetic() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0, 0.5]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    # token 0 in prompt only; token 1 in output once; token 2 in output twice; 3, 4 unseen.
    out = apply_penalties(logits.clone(), [_row(params, prompt=[0], out=[1, 2, 2])])
    expected = [2.0 / 2, -2.0 * 2 - 0.5 - 0.25, 1.0 / 2 - 1.0 - 0.25, 1.0, 0.5]
    assert out[0].tolist() == pytest.approx(expected)


def test_penalties_change_the_greedy_choice_only_where_asked() -> None:
    logits = torch.tensor([[3.0, 2.9], [3.0, 2.9]])
    rows = [
        _row(SamplingParams(temperature=0, frequency_penalty=1.0), out=[0]),
        _row(SamplingParams(temperature=0), out=[0]),
    ]
    assert Sampler()(logits, rows).token_ids == [1, 0]


def test_seeded_rows_are_reproducible_and_independent_of_the_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = SamplingParams(temperature=1.0, seed=1234)

    def draw(n_rows: int, engine_seed: int) -> int:
        generator = torch.Generator().manual_seed(1234)
        rows = [_row(params, generator=generator)] + [_row(SamplingParams())] * (n_rows - 1)
        return Sampler(seed=engine_seed)(logits[:n_rows], rows).token_ids[0]

    tokens_a = [draw(1, engine_seed) for engine_seed in range(3)]
    tokens_b = [draw(3, engine_seed) for engine_seed in range(3)]
    assert tokens_a == tokens_b and len(set(tokens_a)) == 1
    # A generator that keeps running yields a sequence that differs from step to step.
    generator = torch.Generator().manual_seed(1234)
    seq = [
        Sampler()(logits[:1], [_row(params, generator=generator)]).token_ids[0] for _ in range(20)
    ]
    assert len(set(seq)) > 1


def test_random_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([[0.0, math.log(3.0)]])  # p = 0.25, 0.75
    generator = torch.Generator().manual_seed(0)
    rows = [_row(SamplingParams(temperature=1.0), generator=generator)]
    sampler = Sampler()
    hits = sum(sampler(logits, rows).token_ids[0] for _ in range(2000))
    assert 0.70 < hits / 2000 < 0.80


def test_masked_tokens_are_never_sampled() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]]).repeat(64, 1)
    rows = [_row(SamplingParams(temperature=5.0, top_k=2))] * 64
    tokens = Sampler(seed=3)(logits, rows).token_ids
    assert set(tokens) <= {1, 2} and len(set(tokens)) == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"min_p": 1.5},
        {"repetition_penalty": 0.0},
        {"presence_penalty": 3.0},
        {"frequency_penalty": -2.5},
        {"max_tokens": 0},
        {"stop": [""]},
        {"stop_token_ids": [-1]},
        {"temperature": float("nan")},
    ],
)
def test_out_of_range_values_are_invalid_requests(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]
