"""Speculative decoding: greedy output token-identical to decoding without it (ngram, MTP and
draft-model drafts; tiny, small, Qwen3, DeepSeek and SmolLM2; one rank and TP 2), the sampled
distribution unchanged (and a biased acceptance rule caught), KV of rejected drafts rolled back,
preemption and aborts mid-speculation leaving full pools. MTP across the transfer (pages copied
between a prefill and a decode engine): the decoder drafts from its first step with the shipped
hidden state, every draft is the module's one-pass prediction, and without the state it cannot
draft."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import Tensor

from tests.engine.engine_helpers import (
    make_engine,
    prompts_of_lengths,
    repetitive_prompts,
    run_engine,
)
from tests.engine.model_helpers import reference_mtp_draft, reference_mtp_drafts
from workers.engine import engine_core, speculator
from workers.engine.config import EngineConfig
from workers.engine.kv_cache import copy_pages
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence as Seq
from workers.engine.speculative import SpeculativeConfig, accepted_prefix, propose_ngram

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=3)


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3]
    # "2 3" last occurred followed by 5 6 7 (the latest match wins over the earlier 2 3 4).
    assert propose_ngram(tokens, 3, 1, 3) == [5, 6, 7]
    assert propose_ngram(tokens, 1, 1, 3) == [5]
    # The longest n first: "7 2 3" never occurred before, "2 3" did.
    assert propose_ngram([7, 2, 3, 8, 1, 7, 2, 3], 2, 1, 3) == [8, 1]
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []  # nothing repeats
    assert propose_ngram([5], 3, 1, 3) == []
    assert propose_ngram([4, 4, 4], 2, 2, 2) == [4]  # a match needs a token after it


def test_accepted_prefix_keeps_drafts_while_they_match() -> None:
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted_prefix([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accepted_prefix([5, 6, 7], [4, 6, 7, 8]) == 0


def test_config_refuses_what_does_not_exist() -> None:
    with pytest.raises(ValueError, match="needs a model"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="needs a model"):
        SpeculativeConfig(method="ngram", model="/models/small")
    with pytest.raises(ValueError, match="must be one of"):
        SpeculativeConfig(method="eagle9")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="unknown speculative option"):
        SpeculativeConfig.from_dict({"method": "ngram", "k": 3})
    with pytest.raises(ValueError, match="mixed and decode"):
        EngineConfig(role="prefill", speculative=NGRAM)
    # The prefix cache keeps no MTP-layer KV (ngram and draft-model drafts cache: see
    # tests/engine/test_kv_page_cache.py).
    with pytest.raises(ValueError, match="MTP speculative decoding with enable_prefix_caching"):
        EngineConfig(enable_prefix_caching=True, speculative=SpeculativeConfig(method="mtp"))


@pytest.mark.parametrize(
    "fixture", ["tiny_model_dir", "small_model_dir", "qwen3_model_dir", "deepseek_model_dir"]
)
def test_greedy_tokens_equal_decoding_without_speculation(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    model_dir = Path(request.getfixturevalue(fixture))
    prompts = repetitive_prompts([9, 30, 64, 130]) + prompts_of_lengths([17, 50], seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = run_engine(make_engine(model_dir, max_num_batched_tokens=64), prompts, params)
    engine = make_engine(model_dir, max_num_batched_tokens=64, speculative=NGRAM)
    # Alone, then all together (speculating and prefilling sequences in one step).
    assert run_engine(engine, prompts[1:2], params) == expected[1:2]
    assert run_engine(engine, prompts, params) == expected
    stats = engine.stats
    assert stats.num_draft_tokens > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both outcomes exercised
    per_pos = stats.num_accepted_tokens_per_pos
    assert sum(per_pos) == stats.num_accepted_tokens
    assert per_pos == sorted(per_pos, reverse=True)  # a draft is kept only after the ones before
    # Fewer steps than tokens: some steps emitted several.
    assert stats.num_sampled_tokens == sum(len(t) for t in expected) + len(expected[1])


@pytest.mark.slow
def test_smollm2_speculates_with_the_same_tokens(demo_model_dir: Path) -> None:
    """The real checkpoint on text that copies its prompt: ngram drafts are kept often, and
    drafting with the checkpoint itself keeps all; the tokens are the plain engine's."""
    from workers.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(demo_model_dir)
    text = (
        "Repeat the list exactly.\nList: apples, pears, plums, cherries, grapes, lemons, limes."
        "\nRepeated list: apples, pears,"
    )
    prompts = [tokenizer.encode(text), tokenizer.encode("def fibonacci(n):")]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    expected = run_engine(make_engine(demo_model_dir, num_pages=64), prompts, params)
    ngram = make_engine(demo_model_dir, num_pages=64, speculative=NGRAM)
    assert run_engine(ngram, prompts, params) == expected
    assert ngram.stats.num_accepted_tokens > 0
    itself = make_engine(demo_model_dir, num_pages=64, speculative=_draft(demo_model_dir, 2))
    assert run_engine(itself, prompts, params) == expected
    assert itself.stats.num_accepted_tokens == itself.stats.num_draft_tokens > 0


def test_stop_tokens_and_max_tokens_hold_inside_a_verified_run(tiny_model_dir: Path) -> None:
    prompts = repetitive_prompts([40, 41, 42])
    plain = make_engine(tiny_model_dir)
    reference = run_engine(plain, prompts, SamplingParams(temperature=0.0, max_tokens=20))
    engine = make_engine(tiny_model_dir, speculative=NGRAM)
    for max_tokens in (1, 2, 5, 20):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        assert run_engine(engine, prompts, params) == [t[:max_tokens] for t in reference]
    # A stop id inside a run of kept drafts ends the request there.
    stop = reference[0][3]
    params = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop])
    (got,) = run_engine(engine, prompts[:1], params)
    assert got == reference[0][: reference[0].index(stop) + 1]


def test_preemption_during_speculation_recomputes(tiny_model_dir: Path) -> None:
    prompts = repetitive_prompts([60, 70, 80, 90, 100])
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = run_engine(make_engine(tiny_model_dir), prompts, params)
    # 24 pages of 16 tokens for five sequences of up to 140 tokens: they take turns.
    engine = make_engine(tiny_model_dir, num_pages=24, max_num_batched_tokens=64, speculative=NGRAM)
    assert run_engine(engine, prompts, params) == expected
    assert engine.stats.num_preemptions > 0 and engine.stats.num_accepted_tokens > 0


def test_abort_mid_speculation_frees_every_page(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, speculative=NGRAM)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for i, prompt in enumerate(repetitive_prompts([30, 50, 70])):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(12):
        engine.step()
    assert engine.stats.num_draft_tokens > 0
    for i in range(3):
        engine.abort(f"r{i}")
    while engine.has_unfinished():
        engine.step()
    engine.check_invariants()
    assert engine.block_manager.num_free_pages == engine.num_pages


# --- the distribution -------------------------------------------------------------------------

SAMPLES = 300
POSITION = 1  # the second output token: the first one a draft can decide


def _tokens_at_position(model_dir: Path, speculative: SpeculativeConfig | None) -> Counter[int]:
    engine = make_engine(
        model_dir, max_num_seqs=128, max_num_batched_tokens=4096, speculative=speculative
    )
    # Every byte token once: whatever the first output token, prompt lookup finds it and drafts.
    prompt = torch.randperm(256, generator=torch.Generator().manual_seed(5)).tolist()
    counts: Counter[int] = Counter()
    params = [
        SamplingParams(
            temperature=1.0, top_k=6, max_tokens=POSITION + 3, seed=seed, ignore_eos=True
        )
        for seed in range(SAMPLES)
    ]
    tokens = {f"s{i}": [] for i in range(SAMPLES)}
    for i, p in enumerate(params):
        engine.add_request(f"s{i}", prompt, p)
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
    for sequence in tokens.values():
        counts[sequence[POSITION]] += 1
    if speculative is not None:
        assert engine.stats.num_draft_tokens > 0
    return counts


def _chi_square_differs(a: Counter[int], b: Counter[int]) -> bool:
    """Two-sample chi-square test of equal distributions at the 0.1% level (categories with
    fewer than 10 draws in both samples pooled)."""
    categories = sorted(set(a) | set(b))
    small = [c for c in categories if a[c] + b[c] < 10]
    cells = [(a[c], b[c]) for c in categories if c not in small]
    cells.append((sum(a[c] for c in small), sum(b[c] for c in small)))
    cells = [cell for cell in cells if sum(cell) > 0]
    total_a, total_b = sum(a.values()), sum(b.values())
    statistic = 0.0
    for count_a, count_b in cells:
        pooled = (count_a + count_b) / (total_a + total_b)
        for count, total in ((count_a, total_a), (count_b, total_b)):
            expected = pooled * total
            statistic += (count - expected) ** 2 / expected
    df = len(cells) - 1
    # Wilson-Hilferty approximation of the chi-square 0.999 quantile (z = 3.09).
    critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    return statistic > critical


@pytest.fixture(scope="module")
def plain_counts(tiny_model_dir: Path) -> Counter[int]:
    return _tokens_at_position(tiny_model_dir, None)


def test_sampling_keeps_the_target_distribution(
    tiny_model_dir: Path, plain_counts: Counter[int]
) -> None:
    counts = _tokens_at_position(tiny_model_dir, NGRAM)
    assert len(plain_counts) > 1  # a real distribution, not one token
    assert not _chi_square_differs(plain_counts, counts)


def test_a_biased_acceptance_rule_is_caught(
    tiny_model_dir: Path, plain_counts: Counter[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Keeping every draft whatever the target sampled: the drafts' tokens are over-represented.
    monkeypatch.setattr(speculator, "accepted_prefix", lambda drafts, sampled: len(drafts))
    counts = _tokens_at_position(tiny_model_dir, NGRAM)
    assert _chi_square_differs(plain_counts, counts)


def test_llm_takes_a_speculative_config_mapping(tiny_model_dir: Path) -> None:
    from workers.engine.llm import LLM

    prompts = repetitive_prompts([20, 33])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(tiny_model_dir, detokenize=False, num_pages=64) as plain:
        expected = [r.token_ids for r in plain.generate(prompts, params)]
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    with LLM(tiny_model_dir, detokenize=False, num_pages=64, speculative_config=spec) as llm:
        assert llm.engine.config.speculative == SpeculativeConfig(
            num_speculative_tokens=2, prompt_lookup_max=2
        )
        assert [r.token_ids for r in llm.generate(prompts, params)] == expected


def test_a_decode_group_takes_speculative_from_the_cluster_config(tmp_path: Path) -> None:
    from orchestrator.config.base import ConfigError
    from orchestrator.config.cluster import ClusterConfig
    from tests.orchestrator.config.config_helpers import TINY_SHAPE, write_model

    model = write_model(tmp_path / "model", **TINY_SHAPE)
    fabric = {"provider": "tcp;ofi_rxm"}
    groups: dict[str, dict[str, object]] = {
        "prefill": {"fabric": fabric},
        "decode": {"fabric": fabric, "speculative": {"num_speculative_tokens": 4}},
    }
    config = ClusterConfig.from_dict({"model": str(model), "groups": groups})
    assert config.engine_config("decode").speculative == SpeculativeConfig(num_speculative_tokens=4)
    assert config.engine_config("prefill").speculative is None
    # Prefix caching is on by default beside ngram and draft-model drafts.
    assert config.engine_config("decode").enable_prefix_caching
    groups["decode"]["speculative"] = {"method": "draft_model", "model": str(model)}
    config = ClusterConfig.from_dict({"model": str(model), "groups": groups})
    assert config.engine_config("decode").speculative == SpeculativeConfig(
        method="draft_model", model=str(model)
    )
    groups["decode"]["speculative"] = {"method": "draft_model"}
    with pytest.raises(ConfigError, match="needs a model"):
        ClusterConfig.from_dict({"model": str(model), "groups": groups})
    groups["prefill"]["speculative"] = {}
    with pytest.raises(ConfigError, match=r"groups\.prefill\.speculative"):
        ClusterConfig.from_dict({"model": str(model), "groups": groups})
    del groups["prefill"]["speculative"]
    groups["decode"]["speculative"] = {"method": "medusa"}
    with pytest.raises(ConfigError, match=r"groups\.decode\.speculative\.method"):
        ClusterConfig.from_dict({"model": str(model), "groups": groups})
    groups["decode"]["speculative"] = {"method": "mtp", "num_speculative_tokens": 1}
    with pytest.raises(ConfigError, match="mtp needs a checkpoint with MTP modules"):
        ClusterConfig.from_dict({"model": str(model), "groups": groups})


def test_decoders_drafting_with_mtp_get_the_mtp_layer_from_prefill(
    deepseek_model_dir: Path,
) -> None:
    from orchestrator.config.cluster import ClusterConfig

    fabric = {"provider": "tcp;ofi_rxm"}
    mtp = {"method": "mtp", "num_speculative_tokens": 1}
    groups: dict[str, dict[str, object]] = {
        "prefill": {"fabric": fabric},
        "decode": {"fabric": fabric, "speculative": mtp},
    }
    config = ClusterConfig.from_dict({"model": str(deepseek_model_dir), "groups": groups})
    assert config.engine_config("prefill").mtp_kv
    assert not config.engine_config("decode").mtp_kv
    # The prefix cache keeps no MTP-layer KV: off by default on both sides of MTP drafting.
    assert not config.engine_config("prefill").enable_prefix_caching
    assert not config.engine_config("decode").enable_prefix_caching
    del groups["decode"]["speculative"]
    config = ClusterConfig.from_dict({"model": str(deepseek_model_dir), "groups": groups})
    assert not config.engine_config("prefill").mtp_kv


def test_engine_config_round_trips_through_a_mapping() -> None:
    """Workers receive their config serialised: the nested speculative config comes back."""
    import dataclasses

    config = EngineConfig(role="decode", speculative=SpeculativeConfig(num_speculative_tokens=5))
    again = EngineConfig(**dataclasses.asdict(config))
    assert again == config and isinstance(again.speculative, SpeculativeConfig)
    with pytest.raises(ValueError, match="unknown speculative option"):
        EngineConfig(speculative={"method": "ngram", "depth": 2})  # type: ignore[arg-type]


def test_tensor_parallel_engine_speculates_with_the_same_tokens(small_model_dir: Path) -> None:
    prompts = repetitive_prompts([33, 70])
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = run_engine(make_engine(small_model_dir), prompts, params)
    engine = make_engine(small_model_dir, tensor_parallel_size=2, speculative=NGRAM)
    try:
        assert run_engine(engine, prompts, params) == expected
        assert engine.stats.num_draft_tokens > 0
    finally:
        engine.close()


def test_penalties_and_logprobs_are_as_without_speculation(tiny_model_dir: Path) -> None:
    """Each verified position is sampled with the drafts before it in its history: penalties
    see them, and each emitted token's logprob is its own position's."""
    prompts = repetitive_prompts([40, 64])
    params = SamplingParams(
        temperature=0.0,
        max_tokens=20,
        ignore_eos=True,
        repetition_penalty=1.05,
        frequency_penalty=0.05,
        logprobs=True,
    )

    def generate(engine: engine_core.EngineCore) -> dict[str, tuple[list[int], list[float]]]:
        out: dict[str, tuple[list[int], list[float]]] = {}
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
            out[f"r{i}"] = ([], [])
        while engine.has_unfinished():
            for output in engine.step():
                out[output.request_id][0].extend(output.new_token_ids)
                out[output.request_id][1].extend(output.logprobs or [])
        return out

    expected = generate(make_engine(tiny_model_dir))
    engine = make_engine(tiny_model_dir, speculative=NGRAM)
    got = generate(engine)
    assert engine.stats.num_accepted_tokens > 0
    for request_id, (tokens, logprobs) in expected.items():
        assert got[request_id][0] == tokens
        assert got[request_id][1] == pytest.approx(logprobs, abs=1e-4)


# --- MTP drafts (DeepSeek-V3's multi-token prediction module) ------------------------------------

MTP = SpeculativeConfig(method="mtp", num_speculative_tokens=1)


@pytest.mark.parametrize("budget", [16, 64, 2048])
def test_mtp_drafts_keep_greedy_parity(deepseek_model_dir: Path, budget: int) -> None:
    prompts = prompts_of_lengths([5, 17, 40, 100], seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = run_engine(
        make_engine(deepseek_model_dir, max_num_batched_tokens=budget), prompts, params
    )
    engine = make_engine(deepseek_model_dir, max_num_batched_tokens=budget, speculative=MTP)
    assert run_engine(engine, prompts, params) == expected
    assert engine.stats.num_draft_tokens > 0


def test_mtp_draft_is_the_modules_prediction_from_the_whole_sequence(
    deepseek_model_dir: Path,
) -> None:
    """The drafter's MTP KV, built chunk by chunk, decode by decode and across rejected drafts,
    gives the same draft as one pass over the whole sequence."""
    engine = make_engine(deepseek_model_dir, max_num_batched_tokens=16, speculative=MTP)
    (prompt,) = prompts_of_lengths([40], seed=3)
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    seen: list[tuple[list[int], int]] = []
    while engine.has_unfinished():
        engine.step()
        seq = engine._requests.get("r")
        if seq is not None and seq.mtp_draft is not None:
            seen.append((list(seq.token_ids), seq.mtp_draft))
    assert len(seen) >= 5
    for tokens, draft in seen:
        assert draft == reference_mtp_draft(deepseek_model_dir, tokens)


@pytest.mark.parametrize("budget", [16, 2048])
def test_mtp_chains_the_module_for_more_drafts(deepseek_model_dir: Path, budget: int) -> None:
    """k = 3 from one module: the same tokens as without speculation, and each step's drafts
    are the module chained from scratch over the sequence (its scratch KV past the sequence
    is rewritten once the drafts are verified)."""
    prompts = prompts_of_lengths([5, 17, 40], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = run_engine(make_engine(deepseek_model_dir), prompts, params)
    mtp3 = SpeculativeConfig(method="mtp", num_speculative_tokens=3)
    engine = make_engine(deepseek_model_dir, max_num_batched_tokens=budget, speculative=mtp3)
    drafts: list[tuple[list[int], list[int]]] = []
    propose = engine.speculator.propose  # type: ignore[union-attr]

    def recording_propose(running: list[Seq], waiting: list[Seq]) -> None:
        propose(running, waiting)
        drafts.extend(
            (list(s.token_ids), list(s.spec_token_ids)) for s in running if s.spec_token_ids
        )

    engine.speculator.propose = recording_propose  # type: ignore[union-attr,method-assign]
    assert run_engine(engine, prompts, params) == expected
    assert any(len(d) == 3 for _, d in drafts)
    assert engine.stats.num_draft_tokens == sum(len(d) for _, d in drafts)
    for tokens, chain in drafts:
        assert chain == reference_mtp_drafts(deepseek_model_dir, tokens, len(chain))


def test_tensor_parallel_engine_drafts_with_the_module_on_every_rank(
    deepseek_model_dir: Path,
) -> None:
    """TP 2: the followers run their shard of the module's layer on the steps the leader sends;
    the same tokens as without speculation, and the drafts are the one-rank module's."""
    prompts = prompts_of_lengths([17, 40], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = run_engine(make_engine(deepseek_model_dir), prompts, params)
    engine = make_engine(
        deepseek_model_dir, tensor_parallel_size=2, max_num_batched_tokens=16, speculative=MTP
    )
    drafts: list[tuple[list[int], int]] = []
    try:
        propose = engine.speculator.propose  # type: ignore[union-attr]

        def recording_propose(running: list[Seq], waiting: list[Seq]) -> None:
            propose(running, waiting)
            drafts.extend(
                (list(s.token_ids), s.spec_token_ids[0]) for s in running if s.spec_token_ids
            )

        engine.speculator.propose = recording_propose  # type: ignore[union-attr,method-assign]
        assert run_engine(engine, prompts, params) == expected
    finally:
        engine.close()
    assert len(drafts) >= 5
    for tokens, draft in drafts:
        assert draft == reference_mtp_draft(deepseek_model_dir, tokens)


def test_mtp_needs_a_checkpoint_with_the_module(tiny_model_dir: Path) -> None:
    from workers.engine.errors import UnsupportedCheckpointError

    with pytest.raises(UnsupportedCheckpointError, match="MTP modules"):
        make_engine(tiny_model_dir, speculative=MTP)
    with pytest.raises(UnsupportedCheckpointError, match="MTP modules"):
        make_engine(tiny_model_dir, role="prefill", mtp_kv=True)
    with pytest.raises(ValueError, match="mtp_kv is for the prefill role"):
        make_engine(tiny_model_dir, role="decode", mtp_kv=True)


# --- MTP on a disaggregated decoder: the prefill computes the module's KV, ships the hidden state


def _prefill_one(prefill: engine_core.EngineCore, prompt: list[int]) -> tuple[list[int], Tensor]:
    """Prefill ``prompt`` alone on a prefill-role engine; its pages and the final hidden state
    of its last prefilled position (what the KV messenger ships as the context write)."""
    rows: list[Tensor] = []
    hook = prefill.model.norm.register_forward_hook(
        lambda _m, _a, out: rows.append(out[-1].clone())
    )
    try:
        prefill.add_request("p", prompt, SamplingParams(max_tokens=1))
        while prefill.has_unfinished():
            prefill.step()
    finally:
        hook.remove()
    pages = prefill.pages_of("p")
    return pages, rows[-1]


def _disaggregated_mtp_run(
    model_dir: Path,
    prompts: list[list[int]],
    params: SamplingParams,
    ship: str = "hidden",
    decode_pages: int = 80,
    tp: int = 1,
    k: int = 1,
) -> tuple[list[list[int]], engine_core.EngineCore, list[tuple[list[int], list[int]]]]:
    """Each prompt prefilled on a prefill engine with ``mtp_kv``, its pages (every layer, the
    MTP layer's included) copied into a decoder that drafts ``k`` tokens with MTP; ``ship``: the
    hidden state handed over (``hidden``), a wrong one (``zeros``) or none (``none``). Returns
    the tokens, the decoder and every step's drafts with the tokens they follow."""
    prefill = make_engine(
        model_dir,
        role="prefill",
        mtp_kv=True,
        num_pages=40,
        max_num_batched_tokens=16,
        tensor_parallel_size=tp,
    )
    decode = make_engine(
        model_dir,
        role="decode",
        num_pages=decode_pages,
        speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=k),
        tensor_parallel_size=tp,
    )
    try:
        return _disaggregated_mtp_steps(prefill, decode, prompts, params, ship)
    finally:
        prefill.close()
        decode.close()


def _disaggregated_mtp_steps(
    prefill: engine_core.EngineCore,
    decode: engine_core.EngineCore,
    prompts: list[list[int]],
    params: SamplingParams,
    ship: str,
) -> tuple[list[list[int]], engine_core.EngineCore, list[tuple[list[int], list[int]]]]:
    decode.allocate_pinned(3)  # page ids differ between the two sides
    assert prefill.kv_cache.shape[0] == decode.kv_cache.shape[0] == prefill.kv_layers
    for i, prompt in enumerate(prompts):
        src, hidden = _prefill_one(prefill, prompt)
        dst = decode.allocate_pinned(decode.num_prefill_pages(len(prompt)))
        for source, target in zip(prefill.rank_kv_caches, decode.rank_kv_caches, strict=True):
            copy_pages(source, src, target, dst)
        prefill.release("p")
        shipped = {"hidden": hidden, "zeros": torch.zeros_like(hidden), "none": None}[ship]
        decode.add_prefilled_request(f"r{i}", prompt, params, dst, shipped)
    assert prefill.block_manager.num_free_pages == prefill.num_pages
    # (request, tokens before the draft) -> draft; a request still waiting keeps its draft.
    drafts: dict[tuple[str, int], tuple[list[int], list[int]]] = {}
    propose = decode.speculator.propose  # type: ignore[union-attr]

    def recording_propose(running: list[Seq], waiting: list[Seq]) -> None:
        propose(running, waiting)
        for seq in [*running, *waiting]:
            if seq.spec_token_ids:
                key = (seq.request_id, seq.num_tokens)
                drafts[key] = (list(seq.token_ids), list(seq.spec_token_ids))

    decode.speculator.propose = recording_propose  # type: ignore[union-attr,method-assign]
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while decode.has_unfinished():
        for output in decode.step():
            tokens[output.request_id].extend(output.new_token_ids)
    decode.check_invariants()
    assert decode.block_manager.num_free_pages == decode.num_pages - 3
    return list(tokens.values()), decode, list(drafts.values())


MTP_PROMPT_LENGTHS = [2, 17, 40]


@pytest.mark.parametrize(("decode_pages", "k"), [(80, 1), (11, 1), (80, 3)])
def test_mtp_decoder_drafts_from_its_first_step_with_greedy_parity(
    deepseek_model_dir: Path, decode_pages: int, k: int
) -> None:
    """A decoder fed by a prefill worker that computed the MTP layer drafts from its first step
    (the module run at the last prefilled position from the shipped hidden state): the same
    tokens as without speculation, and every draft, the first included, is the module's
    one-pass prediction over the whole sequence; also when a small pool preempts (the
    sequence then recomputes its main and MTP KV itself), and with chained drafts."""
    prompts = prompts_of_lengths(MTP_PROMPT_LENGTHS, seed=5)
    max_tokens = 8 if decode_pages > 11 else 30
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    expected = run_engine(make_engine(deepseek_model_dir), prompts, params)
    tokens, decode, drafts = _disaggregated_mtp_run(
        deepseek_model_dir, prompts, params, decode_pages=decode_pages, k=k
    )
    assert tokens == expected
    assert (decode.stats.num_preemptions > 0) == (decode_pages == 11)
    _check_drafts(deepseek_model_dir, prompts, decode, drafts)


def _check_drafts(
    model_dir: Path,
    prompts: list[list[int]],
    decode: engine_core.EngineCore,
    drafts: list[tuple[list[int], list[int]]],
) -> None:
    """Every prompt drafted before its first step, and every step's drafts are the module's
    (chained) prediction from scratch over the tokens they follow."""
    assert decode.stats.num_draft_tokens == sum(len(chain) for _, chain in drafts) > 0
    firsts = [tokens for tokens, _ in drafts if tokens in prompts]
    assert sorted(firsts) == sorted(prompts)
    for sequence, chain in drafts:
        assert chain == reference_mtp_drafts(model_dir, sequence, len(chain))


def test_tensor_parallel_prefill_and_decoder_carry_the_mtp_layer(deepseek_model_dir: Path) -> None:
    """TP 2 on both sides: each prefill rank computes its shard of the module's layer (the
    latent it stores is whole on every rank), each decode rank runs its shard of the module,
    chained for a second draft."""
    prompts = prompts_of_lengths([17, 40], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = run_engine(make_engine(deepseek_model_dir), prompts, params)
    tokens, decode, drafts = _disaggregated_mtp_run(deepseek_model_dir, prompts, params, tp=2, k=2)
    assert tokens == expected
    _check_drafts(deepseek_model_dir, prompts, decode, drafts)


def test_mtp_decoder_without_the_shipped_hidden_state_cannot_draft(
    deepseek_model_dir: Path,
) -> None:
    """The first draft reads the shipped hidden state: a wrong one gives other first drafts
    than the module's (outputs stay lossless), none gives no drafts at all (the MTP layer's KV
    stops one position short and is never completed)."""
    prompts = prompts_of_lengths(MTP_PROMPT_LENGTHS, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = run_engine(make_engine(deepseek_model_dir), prompts, params)
    tokens, _, drafts = _disaggregated_mtp_run(deepseek_model_dir, prompts, params, "zeros")
    assert tokens == expected
    firsts = [(tokens, chain[0]) for tokens, chain in drafts if tokens in prompts]
    assert len(firsts) == len(prompts)
    assert any(draft != reference_mtp_draft(deepseek_model_dir, t) for t, draft in firsts)
    tokens, decode, drafts = _disaggregated_mtp_run(deepseek_model_dir, prompts, params, "none")
    assert tokens == expected
    assert drafts == [] and decode.stats.num_draft_tokens == 0


# --- draft-model drafts ------------------------------------------------------------------------


def _draft(model_dir: Path, k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model=str(model_dir), num_speculative_tokens=k)


def test_the_model_as_its_own_draft_is_always_right(small_model_dir: Path) -> None:
    """Drafting with the target's own checkpoint, every greedy draft is kept: the draft KV
    (caught up chunk by chunk, past rejected positions and preemptions) is the target's."""
    prompts = prompts_of_lengths([5, 17, 40, 100], seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = run_engine(make_engine(small_model_dir, max_num_batched_tokens=64), prompts, params)
    for pages in (256, 14):  # 14 pages of 16 tokens: the four sequences take turns
        engine = make_engine(
            small_model_dir,
            num_pages=pages,
            max_num_batched_tokens=64,
            speculative=_draft(small_model_dir),
        )
        assert run_engine(engine, prompts, params) == expected
        stats = engine.stats
        assert stats.num_draft_tokens > 0
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert (stats.num_preemptions > 0) == (pages == 14)


def test_a_smaller_draft_model_keeps_greedy_parity(
    small_model_dir: Path, tiny_model_dir: Path
) -> None:
    prompts = repetitive_prompts([9, 30, 64]) + prompts_of_lengths([17, 50], seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    expected = run_engine(make_engine(small_model_dir, max_num_batched_tokens=64), prompts, params)
    engine = make_engine(
        small_model_dir, max_num_batched_tokens=64, speculative=_draft(tiny_model_dir, 2)
    )
    assert run_engine(engine, prompts, params) == expected
    assert engine.stats.num_draft_tokens > 0


def test_a_tensor_parallel_model_drafts_with_a_single_rank_draft(small_model_dir: Path) -> None:
    prompts = prompts_of_lengths([17, 40], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = run_engine(make_engine(small_model_dir), prompts, params)
    engine = make_engine(
        small_model_dir, tensor_parallel_size=2, speculative=_draft(small_model_dir)
    )
    try:
        assert run_engine(engine, prompts, params) == expected
        assert engine.stats.num_accepted_tokens > 0
    finally:
        engine.close()


def test_a_draft_model_must_share_the_tokenizer(small_model_dir: Path, tmp_path: Path) -> None:
    from tests.engine.model_helpers import checkpoint_with_config
    from workers.engine.errors import UnsupportedCheckpointError

    other = checkpoint_with_config(small_model_dir, tmp_path / "other", {"vocab_size": 400})
    with pytest.raises(UnsupportedCheckpointError, match="share the tokenizer"):
        make_engine(small_model_dir, speculative=_draft(other))
