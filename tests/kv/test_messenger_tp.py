"""Disaggregated serving with tensor-parallel engines on both sides (docs/design.md §4).

Each case runs a real prefill worker process of TP ``p`` (its follower ranks spawned by the
engine, their pools in shared memory mapped into the leader and registered with its one
`TransferEngine`) and an in-process decode worker of TP ``d`` (same), over ``tcp;ofi_rxm``:

- concurrent requests with prompts of 1, 2, 16, 17 and 500 tokens, chunked prefill on (budget
  64 tokens = 4 pages, so the 500-token prompt takes 8 passes), greedy;
- outputs identical to a colocated TP=1 engine, computed once per checkpoint (which is itself
  checked against HF transformers once per checkpoint, not per case);
- per request, the decoder's armed count, the prefill's submitted and planned writes and the
  writes observed at the decoder's NIC all equal the README's formula, computed here
  independently from the head placement (``shards · runs`` or ``shards · 2 · pages`` per layer,
  + 1 context write);
- the context write (hidden state of the last prefilled position, taken on the prefill leader
  after the final norm, where the all-reduced hidden state is complete) matches HF's;
- both pools are full afterwards, every rank process exits, no pool file is left in /dev/shm.

Matrix: all six (p, d) ∈ {(1,1), (2,1), (1,2), (2,2), (1,4), (4,2)} on both checkpoints:
``tiny`` (2 KV heads: TP 4 replicates heads, so (1,4) splits into 2 replica sets and (4,2)
chooses one of 2 source sets) and ``small`` (4 KV heads: sharded everywhere, (4,2)
reconstructs and (1,4) splits pages with K/V as separate writes); and (1,1), (2,1), (1,2), (2,2)
on ``deepseek-tiny`` (MLA: one latent plane, the same on every rank, so every destination rank
takes whole pages from one source rank, ``d · runs`` writes per layer); (1,1) and (2,2) on
``qwen3-moe-tiny``. Speculating decoders: ngram on ``tiny`` (1,1), (2,2), a draft model (1,2); MTP on
``deepseek-tiny`` (1,1), (2,2), the prefill computing the module's layer (one more layer in the
write count) and the decoder's first drafts made from the shipped hidden state. Prefix caching
on both sides at (1,2) and (2,2): a second turn's held pages skipped, parity kept. Cost is dominated by process start-up (torch import, checkpoint load per
rank); every process runs one intra-op thread.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.engine.engine_helpers import (
    _hf_model,
    hf_greedy,
    make_engine,
    prompts_of_lengths,
    repetitive_prompts,
    run_engine,
)
from tests.engine.model_helpers import reference_mtp_draft
from tests.kv.harness import RemotePrefill
from tests.waiting import wait_until
from workers.engine.config import EngineConfig
from workers.engine.model_config import ModelConfig
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence as Seq
from workers.engine.shared_kv import POOL_FILE_PREFIX, SHM_DIR
from workers.engine.speculative import SpeculativeConfig
from workers.service.kv_worker import DecodeWorker

pytestmark = pytest.mark.slow

PROVIDER = "tcp;ofi_rxm"
PAGE = 16
BUDGET = 64
LENGTHS = [1, 2, PAGE, PAGE + 1, 500]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
PREFILL_PAGES = 64
DECODE_PAGES = 80
PAIRS = [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4), (4, 2)]
CASES = [(checkpoint, p, d) for checkpoint in ("tiny", "small") for p, d in PAIRS]
# DeepSeek (MLA): the latent is one "head" on every rank; each decode rank's pages come whole
# from one prefill rank drawn for it.
CASES += [("deepseek", p, d) for p, d in [(1, 1), (2, 1), (1, 2), (2, 2)]]
# Qwen3-MoE: GQA KV like the dense presets, experts split over the ranks on both sides.
CASES += [("qwen3_moe", p, d) for p, d in [(1, 1), (2, 2)]]
CONTEXT_CHECKED = (3, 4)  # the 17- and 500-token prompts: one and several chunks


@dataclass(frozen=True)
class Reference:
    model_dir: Path
    config: ModelConfig
    tokens: list[list[int]]
    hidden: dict[int, torch.Tensor]  # prompt index -> HF hidden state of the last prefilled token


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread here (decode leader, references) and in every spawned process."""
    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    torch.set_num_threads(threads)
    if omp is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = omp


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompts_of_lengths(LENGTHS, seed=11)


@pytest.fixture(scope="module")
def references(
    request: pytest.FixtureRequest, prompts: list[list[int]]
) -> Iterator[dict[str, Reference]]:
    """Colocated TP=1 tokens (== HF greedy) and HF hidden states, once per checkpoint, lazily."""

    class Lazy(dict[str, Reference]):
        def __missing__(self, name: str) -> Reference:
            model_dir = Path(request.getfixturevalue(f"{name}_model_dir"))
            self[name] = reference = _reference(model_dir, prompts)
            return reference

    yield Lazy()


def _reference(model_dir: Path, prompts: list[list[int]]) -> Reference:
    engine = make_engine(model_dir, num_pages=DECODE_PAGES, max_num_batched_tokens=BUDGET)
    tokens = run_engine(engine, prompts, GREEDY)
    for prompt, got in zip(prompts, tokens, strict=True):
        assert got == hf_greedy(model_dir, prompt, GREEDY.max_tokens)
    model = _hf_model(str(model_dir))
    hidden = {}
    with torch.no_grad():
        for index in CONTEXT_CHECKED:
            prompt = prompts[index]
            states = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
            hidden[index] = states[-1][0, len(prompt) - 2].clone()
    return Reference(model_dir, ModelConfig.from_dir(model_dir), tokens, hidden)


# -- the README's write-count formula, independently --------------------------------------------


def num_runs(src: Sequence[int], dst: Sequence[int], segment: int, max_run: int | None) -> int:
    """Maximal stretches where both page ids step by +1, cut at request page indices that are
    multiples of ``segment`` and after ``max_run`` pages."""
    runs = length = 0
    for i in range(len(src)):
        new = (
            i == 0
            or src[i] != src[i - 1] + 1
            or dst[i] != dst[i - 1] + 1
            or (segment and i % segment == 0)
            or (max_run is not None and length == max_run)
        )
        if new:
            runs, length = runs + 1, 0
        length += 1
    return runs


def formula_count(
    p: int,
    d: int,
    heads: int,
    layers: int,
    src: Sequence[int],
    dst: Sequence[int],
    segment: int,
    max_run: int | None,
) -> int:
    """``L · Σ_shards (runs | 2 · pages) + 1``. A replica set has ``min(tp, H)`` ranks, each
    with one head range; a destination set paired with a source set needs one shard per overlap
    of their ranges, ``max`` of the two set sizes; a shard covers whole pages (1 write per run)
    only when both sides' ranges are equal, else K and V are separate writes of every page."""
    src_ranges, dst_ranges = min(p, heads), min(d, heads)
    num_dst_sets = max(1, d // heads)
    shards = num_dst_sets * max(src_ranges, dst_ranges)
    if src_ranges == dst_ranges:
        per_layer = shards * num_runs(src, dst, segment, max_run)
    else:
        per_layer = shards * 2 * len(src)
    return layers * per_layer + 1


# -- one case -------------------------------------------------------------------------------------


def _pool_files(pid: int) -> list[Path]:
    return sorted(SHM_DIR.glob(f"{POOL_FILE_PREFIX}{pid}-*"))


def _kill(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class TPPair:
    """A TP-``p`` prefill worker process and a TP-``d`` decode worker in this process."""

    def __init__(
        self,
        model_dir: Path,
        p: int,
        d: int,
        speculative: SpeculativeConfig | None = None,
        mtp_kv: bool = False,
        prefix_caching: bool = False,
    ) -> None:
        self.prefill: RemotePrefill | None = None
        self.decode: DecodeWorker | None = None
        self.prefill_pids: list[int] = []
        self.decode_pids: list[int] = []
        try:
            self.prefill = RemotePrefill(
                model_dir,
                PROVIDER,
                engine={
                    "num_pages": PREFILL_PAGES,
                    "max_num_batched_tokens": BUDGET,
                    "tensor_parallel_size": p,
                    "mtp_kv": mtp_kv,
                    "enable_prefix_caching": prefix_caching,
                },
                num_threads=1,
                daemon=False,  # it spawns its own ranks
                wait=False,
            )
            self.decode = DecodeWorker(
                model_dir,
                EngineConfig(
                    num_pages=DECODE_PAGES,
                    tensor_parallel_size=d,
                    speculative=speculative,
                    enable_prefix_caching=prefix_caching,
                ),
                provider=PROVIDER,
            )
            tp = self.decode.engine.tp
            self.decode_pids = [proc.pid or 0 for proc in tp.processes] if tp else []
            self.endpoint = self.prefill.wait_started()
            self.prefill_pids = list(self.prefill.call(op="pids"))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop both groups; whatever does not exit in time is killed; no pool file remains."""
        leftovers: list[Path] = []
        try:
            if self.decode is not None:
                self.decode.close()
        finally:
            _kill(self.decode_pids)  # normally gone already (SHUTDOWN from the leader)
            if self.prefill is not None:
                prefill_pid = self.prefill.process.pid or 0
                try:
                    self.prefill.close()
                finally:
                    _kill(self.prefill_pids)
                leftovers += _pool_files(prefill_pid)
            leftovers += _pool_files(os.getpid())
            for path in leftovers:
                path.unlink(missing_ok=True)
        assert not leftovers, f"pool files left in /dev/shm: {leftovers}"

    def alive_ranks(self) -> list[int]:
        return [pid for pid in self.prefill_pids + self.decode_pids if _is_running(pid)]


def _is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("checkpoint", "p", "d"), CASES)
def test_tp_greedy_parity_and_write_count(
    checkpoint: str,
    p: int,
    d: int,
    references: dict[str, Reference],
    prompts: list[list[int]],
) -> None:
    reference = references[checkpoint]
    config = reference.config
    pair = TPPair(reference.model_dir, p, d)
    try:
        _check_case(pair, reference, prompts, p, d, config)
    finally:
        pair.close()
    # A TP rank that outlives its worker fails this wait.
    wait_until(
        lambda: not pair.alive_ranks(), timeout=10, what="every TP rank gone with its worker"
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("method", "p", "d"), [("ngram", 1, 1), ("ngram", 2, 2), ("draft", 1, 2)])
def test_speculating_decoder_keeps_greedy_parity(
    method: str, p: int, d: int, references: dict[str, Reference], prompts: list[list[int]]
) -> None:
    """A decoder with ngram speculative decoding, or drafting with a model (the checkpoint
    itself: every greedy draft is kept), fed over the fabric: the same tokens, the same writes;
    drafts were proposed and verified (the KV that arrived is what they extend; the draft
    model catches up over the prompt it never saw)."""
    reference = references["tiny"]
    spec = (
        SpeculativeConfig(num_speculative_tokens=3)
        if method == "ngram"
        else SpeculativeConfig(
            method="draft_model", model=str(reference.model_dir), num_speculative_tokens=3
        )
    )
    pair = TPPair(reference.model_dir, p, d, spec)
    try:
        _check_case(pair, reference, prompts, p, d, reference.config)
        assert pair.decode is not None
        stats = pair.decode.engine.stats
        assert stats.num_draft_tokens > 0
        if method == "draft":
            assert stats.num_accepted_tokens == stats.num_draft_tokens
    finally:
        pair.close()
    wait_until(
        lambda: not pair.alive_ranks(), timeout=10, what="every TP rank gone with its worker"
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("p", "d"), [(1, 1), (2, 2)])
def test_mtp_decoder_gets_the_mtp_layer_and_drafts_from_the_shipped_state(
    p: int, d: int, references: dict[str, Reference], prompts: list[list[int]]
) -> None:
    """DeepSeek with MTP drafts on the decoder: the prefill worker computes the module's KV of
    the prompt and writes it as one more layer of every page (counted like the others), and the
    decoder's first draft of each request, made from the shipped hidden state before its first
    step, is the module's prediction over the whole prompt."""
    reference = references["deepseek"]
    mtp = SpeculativeConfig(method="mtp", num_speculative_tokens=1)
    pair = TPPair(reference.model_dir, p, d, mtp, mtp_kv=True)
    first_drafts: dict[str, tuple[list[int], int]] = {}
    try:
        assert pair.decode is not None
        speculator = pair.decode.engine.speculator
        assert speculator is not None
        propose = speculator.propose

        def recording_propose(running: list[Seq], waiting: list[Seq]) -> None:
            propose(running, waiting)
            for seq in waiting:
                if seq.spec_token_ids and not seq.num_output_tokens:
                    first_drafts[seq.request_id] = (list(seq.token_ids), seq.spec_token_ids[0])

        speculator.propose = recording_propose  # type: ignore[method-assign]
        layers = reference.config.num_layers + 1
        _check_case(pair, reference, prompts, p, d, reference.config, layers)
    finally:
        pair.close()
    wait_until(
        lambda: not pair.alive_ranks(), timeout=10, what="every TP rank gone with its worker"
    )
    # Every prompt the prefill worker computed (all but the 1-token one) drafted at once.
    assert sorted(first_drafts) == [f"tp{i}" for i in range(1, len(prompts))]
    for tokens, draft in first_drafts.values():
        assert draft == reference_mtp_draft(reference.model_dir, tokens)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("p", "d", "speculating"), [(1, 2, False), (2, 2, False), (1, 1, True)])
def test_prefix_caching_on_both_sides_keeps_parity_and_skips_held_pages(
    p: int, d: int, speculating: bool, references: dict[str, Reference]
) -> None:
    """Prefix caching on both groups under TP: a second turn reuses the prefill worker's
    cached pages (every rank's pool holds their KV) and is written only past the pages the
    decoder holds (every rank's pool), with the tokens of a plain engine; also with a decoder
    that speculates (ngram) and keeps some of its drafts."""
    reference = references["tiny"]
    plain = make_engine(reference.model_dir)
    system, follow_up = prompts_of_lengths([75, 28], seed=21)
    spec = None
    if speculating:
        # A repeated phrase, so that prompt lookup's drafts are kept in the first answer.
        (system,) = repetitive_prompts([75])
        spec = SpeculativeConfig(num_speculative_tokens=3)
    pair = TPPair(reference.model_dir, p, d, spec, prefix_caching=True)
    try:
        assert pair.decode is not None and pair.prefill is not None
        answer, final = pair.decode.submit("turn1", system, GREEDY, pair.endpoint).result(90)
        assert final.error is None and answer == run_engine(plain, [system], GREEDY)[0]
        turn2 = system + answer + follow_up
        tokens, final = pair.decode.submit("turn2", turn2, GREEDY, pair.endpoint).result(90)
        assert final.error is None and tokens == run_engine(plain, [turn2], GREEDY)[0]
        record = pair.decode.transfer_stats("turn2")
        assert record is not None and record["state"] == "ready"
        held = (len(system) + len(answer) - 1) // PAGE
        assert record["num_pages_skipped"] == held
        assert len(record["page_ids"]) == (len(turn2) - 2) // PAGE + 1 - held
        prefill_stats = pair.prefill.stats("turn2")
        max_run = pair.decode.fabric.max_pages_per_run(
            pair.decode.messenger.pools.layout.page_bytes
        )
        config = reference.config
        assert record["num_writes_expected"] == formula_count(
            p,
            d,
            config.num_kv_heads,
            config.num_layers,
            prefill_stats["src_pages"],
            record["page_ids"],
            pair.endpoint.segment_pages,
            max_run,
        )
        assert pair.prefill.state()["num_prefix_cache_hits"] == (len(system) - 1) // PAGE * PAGE
        if speculating:  # some of what the decoder held came from kept drafts
            assert pair.decode.engine.stats.num_accepted_tokens > 0
        wait_until(
            lambda: (
                pair.decode is not None and pair.decode.state()["num_free_pages"] == DECODE_PAGES
            ),
            what="decode pool full",
        )
    finally:
        pair.close()
    wait_until(
        lambda: not pair.alive_ranks(), timeout=10, what="every TP rank gone with its worker"
    )


def _check_case(
    pair: TPPair,
    reference: Reference,
    prompts: list[list[int]],
    p: int,
    d: int,
    config: ModelConfig,
    layers: int | None = None,
) -> None:
    """``layers``: the pools' layers (default: the model's)."""
    assert pair.decode is not None and pair.prefill is not None
    decode, prefill, endpoint = pair.decode, pair.prefill, pair.endpoint
    assert (endpoint.tp_size, endpoint.num_kv_heads) == (p, config.num_kv_heads)
    assert endpoint.segment_pages == BUDGET // PAGE
    assert decode.messenger.pools.tp_size == d
    assert len(pair.prefill_pids) == p - 1 and len(pair.decode_pids) == d - 1
    received_before = decode.imm_writes_received()

    streams = [
        decode.submit(f"tp{i}", prompt, GREEDY, endpoint) for i, prompt in enumerate(prompts)
    ]
    results = [stream.result(90) for stream in streams]
    assert [final.error for _, final in results] == [None] * len(prompts)
    assert [tokens for tokens, _ in results] == reference.tokens

    max_run = decode.fabric.max_pages_per_run(decode.messenger.pools.layout.page_bytes)
    total = 0
    imms: list[int] = []
    for i, prompt in enumerate(prompts):
        decode_stats = decode.transfer_stats(f"tp{i}")
        if len(prompt) == 1:
            assert decode_stats is None  # nothing to prefill
            continue
        prefill_stats = prefill.stats(f"tp{i}")
        assert decode_stats is not None and prefill_stats["state"] == "done"
        expected = formula_count(
            p,
            d,
            config.num_kv_heads,
            layers or config.num_layers,
            prefill_stats["src_pages"],
            decode_stats["page_ids"],
            endpoint.segment_pages,
            max_run,
        )
        assert decode_stats["num_writes_expected"] == expected, f"prompt {i}"
        assert prefill_stats["num_writes"] == prefill_stats["num_writes_planned"] == expected
        assert decode_stats["state"] == "ready"  # its counter fired at exactly ``expected``
        imms.append(decode_stats["imm"])
        total += expected
    # Observed at the decoder's NIC: every counter fired at its count, and the writes that
    # landed are exactly the sum, so none got more (a surplus would also stay buffered under
    # its imm) or fewer than the formula.
    wait_until(lambda: decode.imm_writes_received() - received_before >= total)
    assert decode.imm_writes_received() - received_before == total
    assert [decode.fabric.imm_arrivals(imm) for imm in imms] == [0] * len(imms)

    for index in CONTEXT_CHECKED:
        context = decode.context_state(f"tp{index}")
        torch.testing.assert_close(context, reference.hidden[index], atol=2e-4, rtol=1e-4)

    wait_until(lambda: decode.state()["num_free_pages"] == DECODE_PAGES, what="decode pool full")
    wait_until(lambda: prefill.state()["num_free_pages"] == PREFILL_PAGES, what="prefill pool")
    assert decode.state()["num_transfers"] == 0
    assert prefill.state()["num_transfers"] == 0
