"""Tensor parallelism: real follower processes (spawn), a real gloo group, real /dev/shm pools.

Numerics: TP ranks sum o_proj / down_proj partial products with an all-reduce, so from layer 1
on hidden states (and the KV computed from them) differ from TP=1 by float32 rounding. Layer
0's KV depends on no all-reduce and is compared bit-exactly; the other layers within
``KV_ATOL`` (observed differences are ~4e-6). Replicas of one head (tp > KV heads) see identical
inputs and are compared bit-exactly with each other. Greedy tokens must be identical.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch

from tests.engine.engine_helpers import GREEDY, hf_greedy, make_engine, prompts_of_lengths
from tests.engine.model_helpers import write_attention_bias_checkpoint
from tests.waiting import wait_until
from workers.engine.cpu_gemm import dense
from workers.engine.engine_core import EngineCore
from workers.engine.errors import (
    TensorParallelConfigError,
    TensorParallelError,
    UnsupportedCheckpointError,
)
from workers.engine.layer_progress import LayerProgress
from workers.engine.llm import LLM
from workers.engine.loader import load_model
from workers.engine.model_config import ModelConfig
from workers.engine.parallel import check_tensor_parallel, shard_spec
from workers.engine.scheduler import ScheduledChunk
from workers.engine.shared_kv import POOL_FILE_PREFIX, SHM_DIR, remove_stale_pool_files

pytestmark = pytest.mark.slow

KV_ATOL = 1e-4
BUDGET = 64  # tokens per step: the 130-token prompt runs in several chunks
BATCH_LENGTHS = [1, 7, 17, 50, 130]
POOL_PROMPT_LENGTH = 45  # three pages, the last one partly filled


def _lead_and_wait(model_dir: str, conn: Connection) -> None:
    """Child process: a TP=2 leader that reports its follower's pid, then waits to be killed."""
    from workers.engine.config import EngineConfig

    engine = EngineCore(model_dir, EngineConfig(num_pages=16, tensor_parallel_size=2))
    assert engine.tp is not None
    conn.send([p.pid for p in engine.tp.processes])
    conn.recv()  # never answered: the test kills this process


def _is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _leftover_pool_files() -> list[Path]:
    return sorted(SHM_DIR.glob(f"{POOL_FILE_PREFIX}{os.getpid()}-*"))


def _run(engine: EngineCore, prompts: list[list[int]]) -> tuple[list[list[int]], dict[str, list]]:
    """Greedy tokens per prompt, plus the pages each request wrote and the layer progress seen
    after every step that ran the model."""
    pages: dict[str, list[int]] = {}
    progress: list[tuple[int, int]] = []

    def record(chunks: list[ScheduledChunk]) -> None:
        for chunk in chunks:
            known = pages.setdefault(chunk.request_id, [])
            known.extend(p for p in chunk.page_ids if p not in known)

    engine.on_step_scheduled = record
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    while engine.has_unfinished():
        before = engine.stats.num_steps
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
        if engine.stats.num_steps > before:
            progress.append(engine.layer_progress.read())
    engine.on_step_scheduled = None
    engine.check_invariants()
    return list(tokens.values()), {"pages": list(pages.values()), "progress": progress}


@pytest.fixture(
    scope="module",
    params=[("tiny", 2), ("tiny", 4), ("small", 2), ("deepseek", 2), ("qwen3_moe", 2)],
    ids=lambda p: f"{p[0]}-tp{p[1]}",
)
def case(request: pytest.FixtureRequest) -> Iterator[tuple[Path, EngineCore, EngineCore]]:
    """(checkpoint, TP engine, TP=1 engine) with identical engine settings. DeepSeek: heads
    split, the latent replicated on both ranks, experts split; Qwen3-MoE: experts split."""
    name, tp = request.param
    model_dir = Path(request.getfixturevalue(f"{name}_model_dir"))
    reference = make_engine(model_dir, num_pages=64, max_num_batched_tokens=BUDGET)
    engine = make_engine(
        model_dir, num_pages=64, max_num_batched_tokens=BUDGET, tensor_parallel_size=tp
    )
    try:
        yield model_dir, engine, reference
    finally:
        engine.close()
    assert engine.tp is not None
    assert [p.exitcode for p in engine.tp.processes] == [0] * (tp - 1)  # left on SHUTDOWN
    assert _leftover_pool_files() == []


def test_greedy_tokens_match_tp1_and_hf(case: tuple[Path, EngineCore, EngineCore]) -> None:
    model_dir, engine, reference = case
    prompts = prompts_of_lengths(BATCH_LENGTHS, seed=3)
    expected = [hf_greedy(model_dir, p, GREEDY.max_tokens) for p in prompts]
    # Alone (a short prompt; a long one in chunks), then all together (chunked prefill mixed
    # with decodes).
    for index in (1, 4):
        assert _run(engine, [prompts[index]])[0] == [expected[index]]
    batch_tokens, seen = _run(engine, prompts)
    assert batch_tokens == expected
    assert _run(reference, prompts)[0] == expected
    assert engine.stats.max_step_tokens <= BUDGET
    # The leader's counter reaches every layer in every pass, one pass per step.
    num_layers = engine.model_config.num_layers
    passes = [pass_id for pass_id, _ in seen["progress"]]
    assert {done for _, done in seen["progress"]} == {num_layers}
    assert passes == list(range(passes[0], passes[0] + len(passes)))


def test_rank_pools_hold_their_heads(case: tuple[Path, EngineCore, EngineCore]) -> None:
    _, engine, reference = case
    (prompt,) = prompts_of_lengths([POOL_PROMPT_LENGTH], seed=11)
    _, seen = _run(engine, [prompt])
    _, seen_ref = _run(reference, [prompt])
    tp = engine.config.tensor_parallel_size
    sharding = shard_spec(engine.model_config, tp, 0).kv_sharding
    assert len(engine.rank_kv_caches) == tp
    assert engine.rank_kv_caches[0] is engine.kv_cache

    def prompt_kv(pool: torch.Tensor, page_ids: list[int]) -> torch.Tensor:
        # [L, pages, 2, H, P, D] -> [L, 2, H, tokens, D], only the prompt's token slots.
        kv = pool[:, page_ids].permute(0, 2, 3, 1, 4, 5)
        return kv.flatten(3, 4)[:, :, :, :POOL_PROMPT_LENGTH]

    full = prompt_kv(reference.kv_cache, seen_ref["pages"][0])
    by_head: dict[int, torch.Tensor] = {}
    for rank, pool in enumerate(engine.rank_kv_caches):
        start, count = sharding.head_start(rank), sharding.heads_per_rank
        assert pool.shape[3] == count
        mine = prompt_kv(pool, seen["pages"][0])
        expected = full[:, :, start : start + count]
        assert torch.equal(mine[0], expected[0]), f"rank {rank}: layer 0 differs"
        torch.testing.assert_close(mine, expected, rtol=0, atol=KV_ATOL)
        assert mine.abs().sum() > 0
        if start in by_head:  # another replica of the same head: bit-identical
            assert torch.equal(mine, by_head[start]), f"rank {rank}: replica differs"
        by_head[start] = mine
    assert sorted(by_head) == list(range(0, sharding.num_kv_heads, sharding.heads_per_rank))


def test_layer_marked_after_the_o_proj_all_reduce(tiny_model_dir: Path) -> None:
    """In-process: the progress mark of layer l comes after layer l's attention all-reduce and
    before its MLP all-reduce (a rank-0 shard with a recording reduce; no real peers)."""
    events: list[str] = []

    class Recorder(LayerProgress):
        def mark_layer_done(self, layer: int) -> None:
            events.append(f"mark{layer}")
            super().mark_layer_done(layer)

    config = ModelConfig.from_dir(tiny_model_dir)
    model, _ = load_model(
        tiny_model_dir,
        shard=shard_spec(config, 2, 0),
        reduce=lambda t: events.append(f"reduce{t.shape[-1]}"),
    )
    from tests.engine.model_helpers import PagedRunner

    runner = PagedRunner(model, shard_spec(config, 2, 0).local_config(config))
    runner.step([(0, [1, 2, 3])], Recorder(config.num_layers))
    hidden = config.hidden_size
    assert events == [
        event
        for layer in range(config.num_layers)
        for event in (f"reduce{hidden}", f"mark{layer}", f"reduce{hidden}")
    ]


@pytest.mark.parametrize(("preset", "tp"), [("tiny", 4), ("small", 2), ("qwen2", 2), ("qwen3", 2)])
def test_each_rank_loads_its_slices(preset: str, tp: int, request: pytest.FixtureRequest) -> None:
    """In-process: every rank's parameters are exactly its rows / columns of the full model's
    (q/k/v incl. Qwen2 biases and replicated KV heads, gate/up, o_proj, down_proj)."""
    model_dir = request.getfixturevalue(f"{preset}_model_dir")
    full, config = load_model(model_dir)
    dim, inter = config.head_dim, config.intermediate_size
    q_size, kv_size = config.num_heads * dim, config.num_kv_heads * dim

    kv_heads = config.num_kv_heads

    def fused_rows(weight: torch.Tensor, rank: int) -> torch.Tensor:
        # The convention, written out independently of ShardSpec / GroupSharding.
        if tp <= kv_heads:
            first, count = rank * kv_heads // tp, kv_heads // tp
        else:
            first, count = rank // (tp // kv_heads), 1
        q, k, v = weight.split([q_size, kv_size, kv_size])
        kv_rows = slice(first * dim, (first + count) * dim)
        return torch.cat([q[q_cols], k[kv_rows], v[kv_rows]])

    for rank in range(tp):
        shard, _ = load_model(model_dir, shard=shard_spec(config, tp, rank))
        q_cols = slice(rank * q_size // tp, (rank + 1) * q_size // tp)
        mlp = slice(rank * inter // tp, (rank + 1) * inter // tp)
        for mine, theirs in zip(shard.layers, full.layers, strict=True):
            attn, ref = mine.self_attn, theirs.self_attn
            assert torch.equal(
                dense(attn.qkv_proj_weight), fused_rows(dense(ref.qkv_proj_weight), rank)
            )
            if ref.qkv_proj_bias is not None:
                assert torch.equal(attn.qkv_proj_bias, fused_rows(ref.qkv_proj_bias, rank))
            assert torch.equal(dense(attn.o_proj_weight), dense(ref.o_proj_weight)[:, q_cols])
            gate, up = dense(theirs.mlp.gate_up_proj_weight).split(inter)
            assert torch.equal(dense(mine.mlp.gate_up_proj_weight), torch.cat([gate[mlp], up[mlp]]))
            assert torch.equal(
                dense(mine.mlp.down_proj_weight), dense(theirs.mlp.down_proj_weight)[:, mlp]
            )
        assert torch.equal(dense(shard.lm_head), dense(full.lm_head))


def _children() -> set[int | None]:
    # Engines of the module-scoped fixture may still be alive: compare sets, not emptiness.
    return {p.pid for p in multiprocessing.active_children()}


def test_o_proj_bias_is_added_once_across_ranks(tmp_path: Path) -> None:
    """o_proj is row-parallel: its bias (replicated on every rank) joins after the all-reduce."""
    model_dir = write_attention_bias_checkpoint("tiny", tmp_path)
    prompts = prompts_of_lengths([7, 50], seed=6)
    expected = [hf_greedy(model_dir, p, GREEDY.max_tokens) for p in prompts]
    engine = make_engine(model_dir, num_pages=64, tensor_parallel_size=2)
    try:
        assert _run(engine, prompts)[0] == expected
    finally:
        engine.close()


def test_invalid_tp_fails_before_spawning(tiny_model_dir: Path) -> None:
    config = ModelConfig.from_dir(tiny_model_dir)  # 8 heads, 2 KV heads
    before = _children()
    for tp in (3, 16):
        with pytest.raises(TensorParallelConfigError, match=f"tensor_parallel_size={tp}"):
            make_engine(tiny_model_dir, tensor_parallel_size=tp)
    assert _children() == before
    assert _leftover_pool_files() == []
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        make_engine(tiny_model_dir, tensor_parallel_size=0)
    assert check_tensor_parallel(config, 4).num_replica_sets == 2


def test_failed_start_leaves_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in tiny_model_dir.iterdir():
        if item.name != "model.safetensors":
            (broken / item.name).symlink_to(item)
    from safetensors.torch import load_file, save_file

    tensors = load_file(tiny_model_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, broken / "model.safetensors")
    before = _children()
    with pytest.raises(UnsupportedCheckpointError, match="down_proj"):
        make_engine(broken, tensor_parallel_size=2)
    assert _children() == before
    assert _leftover_pool_files() == []


def test_pool_files_of_a_leader_that_is_gone_are_removed(tmp_path: Path) -> None:
    """A leader killed before it unlinked its followers' pool files leaves them behind with
    their size reserved; the next leader removes them, and never a live leader's."""
    gone = subprocess.Popen(["true"])  # a real process that has exited: its pid is free
    gone.wait()
    stale = tmp_path / f"{POOL_FILE_PREFIX}{gone.pid}-0123abcd-rank1"
    live = tmp_path / f"{POOL_FILE_PREFIX}{os.getpid()}-4567cdef-rank1"
    other = tmp_path / "pdserve-something-else"
    for path in (stale, live, other):
        path.write_bytes(b"\0" * 4096)
    assert remove_stale_pool_files(tmp_path) == 4096
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])


def test_llm_and_follower_death(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = prompts_of_lengths([5, 33], seed=5)
    expected = [hf_greedy(tiny_model_dir, p, GREEDY.max_tokens) for p in prompts]
    before = _children()
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, num_pages=64, detokenize=False)
    try:
        assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
        (follower,) = llm.engine.tp.processes
        assert follower.pid is not None
        os.kill(follower.pid, signal.SIGKILL)
        follower.join()
        # Without the liveness check the step's collectives meet the dead peer: an error, not
        # a hang, naming the rank.
        assert llm.engine.tp is not None
        monkeypatch.setattr(llm.engine.tp, "check_healthy", lambda: None)
        with pytest.raises(TensorParallelError, match=r"rank 1 .*exited with code -9"):
            llm.generate(prompts, GREEDY)
        monkeypatch.undo()
        # The group stays broken.
        with pytest.raises(TensorParallelError, match="rank 1"):
            llm.generate(prompts, GREEDY)
    finally:
        llm.close()
    assert _children() == before
    assert _leftover_pool_files() == []


def test_followers_exit_when_the_leader_dies(tiny_model_dir: Path) -> None:
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    leader = context.Process(target=_lead_and_wait, args=(str(tiny_model_dir), theirs))
    leader.start()
    try:
        follower_pids = ours.recv()
    finally:
        assert leader.pid is not None
        os.kill(leader.pid, signal.SIGKILL)
        leader.join()
    # A generous bound, not a latency check: the follower sees its leader's socket close.
    wait_until(
        lambda: not any(_is_running(pid) for pid in follower_pids),
        timeout=60,
        what="the followers of a dead leader to exit",
    )
