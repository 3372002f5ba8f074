"""Batched token sampling with vLLM semantics.

Order: penalties (repetition, then frequency and presence) → greedy rows take the argmax →
temperature → min-p → top-k → top-p → a random draw. Random rows draw with the exponential race
(``argmax(p / q)``, ``q ~ Exp(1)``), equivalent to sampling from ``p``; a row with a seed draws its
``q`` from its own ``torch.Generator`` so its tokens do not depend on the rest of the batch.

Log-probabilities are those of the model's raw logits (vLLM's default ``raw_logprobs``).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from workers.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs of one request."""

    params: SamplingParams
    prompt_token_ids: SequenceOf[int]
    output_token_ids: SequenceOf[int]
    generator: torch.Generator | None = None


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None  # per row when any row asked for them, else None


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        # Rows without their own seed share this one, so a run is reproducible from the config.
        self.generator = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: SequenceOf[SamplingRow]) -> SamplerOutput:
        """logits: ``[N, vocab]`` float32, one row per request, in ``rows`` order."""
        logits = logits.float()
        raw_logits = logits
        params = [row.params for row in rows]

        if any(p.has_penalties for p in params):
            logits = apply_penalties(logits.clone(), rows)

        token_ids = argmax(logits)
        # Python-side row selection: an all-greedy batch (the common case) builds no tensor.
        random_list = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_list:
            random_rows = torch.tensor(random_list, dtype=torch.long, device=logits.device)
            sub = logits.index_select(0, random_rows)
            sub_params = [params[i] for i in random_list]
            sub_generators = [rows[i].generator for i in random_list]
            probs = probabilities(sub, sub_params)
            sampled = exponential_race(probs, sub_generators, self.generator)
            token_ids = token_ids.index_copy(0, random_rows, sampled)

        logprobs = None
        if any(p.logprobs for p in params):
            chosen = torch.log_softmax(raw_logits, dim=-1).gather(1, token_ids[:, None])
            logprobs = chosen.flatten().tolist()
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value, the first where several tie (NaN counts as the
    largest), as ``Tensor.argmax(dim=-1)`` gives. Why not that: on CPU, ``max(dim=-1)`` runs a
    vectorised reduction that was 2.7x faster in float32 and 4.7x in bfloat16 over 64 rows of
    SmolLM2's 49152 logits (0.85 against 2.3 ms, 1.25 against 5.9 ms; 2-vCPU Xeon VM), the
    same indices, ties and NaN included."""
    return logits.max(dim=-1).indices


def apply_penalties(logits: torch.Tensor, rows: SequenceOf[SamplingRow]) -> torch.Tensor:
    """In place on ``logits`` ``[N, vocab]``; rows without penalties are left unchanged."""
    vocab = logits.shape[-1]
    device = logits.device
    output_counts = _token_counts([row.output_token_ids for row in rows], vocab, device)
    params = [row.params for row in rows]

    repetition = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    if bool((repetition != 1.0).any()):
        prompt_counts = _token_counts([row.prompt_token_ids for row in rows], vocab, device)
        seen = (prompt_counts > 0) | (output_counts > 0)
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalised, logits)

    frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
    logits -= frequency * output_counts
    logits -= presence * (output_counts > 0).to(logits.dtype)
    return logits


def probabilities(logits: torch.Tensor, params: SequenceOf[SamplingParams]) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p masks; returns ``[N, vocab]`` probabilities."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]
    logits = logits / temperature

    min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
    if bool((min_p > 0).any()):
        probs = torch.softmax(logits, dim=-1)
        threshold = min_p * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))

    top_k = [p.top_k if p.top_k > 0 else logits.shape[-1] for p in params]
    top_p = torch.tensor([p.top_p for p in params], device=device)
    if any(k < logits.shape[-1] for k in top_k) or bool((top_p < 1).any()):
        logits = apply_top_k_top_p(logits, torch.tensor(top_k, device=device), top_p)
    return torch.softmax(logits, dim=-1)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Mask all but each row's ``top_k`` largest logits, then all outside its top-p nucleus.

    The nucleus is the smallest set of most likely tokens whose probability reaches ``top_p``
    (the token that crosses the threshold is kept).
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Probability mass strictly before each token; a token is kept while that is below top_p.
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def exponential_race(
    probs: torch.Tensor,
    generators: SequenceOf[torch.Generator | None],
    default_generator: torch.Generator,
) -> torch.Tensor:
    """Sample one token per row of ``probs``; seeded rows use their own generator."""
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        block = torch.empty((len(unseeded), probs.shape[-1]), dtype=probs.dtype)
        block.exponential_(generator=default_generator)
        noise[unseeded] = block.to(probs.device)
    for i, generator in enumerate(generators):
        if generator is not None:
            row = torch.empty(probs.shape[-1], dtype=probs.dtype)
            noise[i] = row.exponential_(generator=generator).to(probs.device)
    return argmax(probs / noise)


def _token_counts(
    token_lists: SequenceOf[SequenceOf[int]], vocab: int, device: torch.device
) -> torch.Tensor:
    counts = torch.zeros((len(token_lists), vocab), dtype=torch.float32, device=device)
    for i, tokens in enumerate(token_lists):
        if len(tokens):
            ids = torch.tensor(list(tokens), dtype=torch.long, device=device)
            counts[i].index_add_(0, ids, torch.ones(len(ids), device=device))
    return counts
