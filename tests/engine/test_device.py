"""The ``device`` option: checked before anything is loaded; CUDA runs match HF (GPU only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import workers.engine.engine_core as engine_core
from tests.engine.engine_helpers import (
    hf_greedy,
    make_engine,
    prompts_of_lengths,
    repetitive_prompts,
    run_engine,
)
from workers.engine.config import EngineConfig
from workers.engine.device import DeviceError, resolve_device
from workers.engine.parallel import rank_devices
from workers.engine.sampling_params import SamplingParams
from workers.engine.speculative import SpeculativeConfig

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("name", ["gpu", "cuda:", "cuda:x", "CPU", "", "cuda:0:1"])
def test_malformed_device_is_refused_by_the_config(name: str) -> None:
    with pytest.raises(DeviceError, match="device must be cpu, cuda, cuda:N or auto"):
        EngineConfig(device=name)


def test_cpu_and_auto_resolve_on_this_host() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_cuda_without_a_gpu_fails_before_the_checkpoint_is_read(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loads: list[Any] = []
    real_load = engine_core.load_model

    def spy(*args: Any, **kwargs: Any) -> Any:  # counts calls, then loads for real
        loads.append(args)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(engine_core, "load_model", spy)
    for name in ("cuda", "cuda:1"):
        with pytest.raises(DeviceError, match="torch sees no CUDA device here"):
            make_engine(tiny_model_dir, device=name)
    assert loads == []
    make_engine(tiny_model_dir, device="auto")  # the spy does load when the device is fine
    assert len(loads) == 1


def test_engine_places_weights_and_kv_on_its_device(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, device="auto")
    device = resolve_device("auto")
    assert engine.device.type == device.type
    assert all(p.device.type == device.type for p in engine.model.parameters())
    assert engine.kv_cache.device.type == device.type


def test_rank_devices_give_each_rank_its_own_gpu_when_there_are_enough() -> None:
    cpu = torch.device("cpu")
    assert rank_devices(cpu, 3, 0) == ([cpu] * 3, "gloo")
    cuda = [torch.device("cuda", i) for i in range(4)]
    assert rank_devices(torch.device("cuda", 1), 4, 4) == (
        [cuda[1], cuda[2], cuda[3], cuda[0]],
        "nccl",
    )
    assert rank_devices(torch.device("cuda", 0), 2, 8) == (cuda[:2], "nccl")
    # Fewer GPUs than ranks: they share (NCCL refuses two ranks on one GPU), gloo reduces.
    assert rank_devices(torch.device("cuda", 0), 4, 2) == ([cuda[0], cuda[1]] * 2, "gloo")


@pytest.mark.gpu
@cuda_only
def test_tensor_parallel_on_cuda_matches_one_rank(tiny_model_dir: Path) -> None:
    """Two ranks on CUDA (on a one-GPU host both on it, all-reduce over gloo): the followers'
    cuMem pools are mapped in the leader, and greedy tokens match the single-rank engine."""
    prompts = prompts_of_lengths([3, 17, 120])
    reference = run_engine(make_engine(tiny_model_dir, device="cuda"), prompts)
    engine = make_engine(tiny_model_dir, device="cuda", tensor_parallel_size=2)
    try:
        assert engine.runner.decode_graphs is None
        assert [pool.device.type for pool in engine.rank_kv_caches] == ["cuda", "cuda"]
        assert run_engine(engine, prompts) == reference
        torch.cuda.synchronize()
        assert all(bool(pool.abs().sum() > 0) for pool in engine.rank_kv_caches)
    finally:
        engine.close()
    assert engine.tp is not None and [p.exitcode for p in engine.tp.processes] == [0]


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize(("chunk", "graphs"), [(16, 64), (2048, 0)])
def test_cuda_greedy_matches_hf_on_cuda(tiny_model_dir: Path, chunk: int, graphs: int) -> None:
    prompts = prompts_of_lengths([1, 7, 16, 17, 50, 300])
    reference = [hf_greedy(tiny_model_dir, p, 8, device="cuda") for p in prompts]
    engine = make_engine(
        tiny_model_dir, device="cuda", max_num_batched_tokens=chunk, cuda_graph_max_batch=graphs
    )
    assert engine.kv_cache.is_cuda
    assert (engine.runner.decode_graphs is None) == (graphs == 0)
    assert type(engine.layer_progress).__name__ == "CudaLayerProgress"
    assert run_engine(engine, prompts) == reference


@pytest.mark.gpu
@cuda_only
def test_cuda_layer_progress_publishes_every_layer_of_each_pass(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, device="cuda")
    layers = engine.model_config.num_layers
    seen: list[tuple[int, int]] = []
    for prompt in prompts_of_lengths([40, 5]):
        run_engine(engine, [prompt])
        torch.cuda.synchronize()
        seen.append(engine.layer_progress.read())
    # The word the device wrote last: every layer of the latest pass, in a later pass each time.
    assert seen[0][1] == seen[1][1] == layers
    assert seen[1][0] > seen[0][0] > 0


def test_negative_cuda_graph_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="cuda_graph_max_batch must be >= 0, got -1"):
        EngineConfig(cuda_graph_max_batch=-1)


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("family", ["qwen3", "qwen2", "deepseek", "deepseek_v2", "qwen3_moe"])
def test_every_model_family_on_cuda_matches_hf_on_cuda(
    family: str, request: pytest.FixtureRequest
) -> None:
    """Qwen's q/k norm and biases, DeepSeek's latent (MLA) cache and routed experts on the GPU:
    HF's greedy tokens on the same GPU. Dense families replay decode graphs; MoE and MLA ones
    run eagerly (their steps cannot be captured)."""
    model_dir = Path(request.getfixturevalue(f"{family}_model_dir"))
    prompts = prompts_of_lengths([1, 7, 17, 50, 300])
    reference = [hf_greedy(model_dir, p, 8, device="cuda") for p in prompts]
    engine = make_engine(model_dir, device="cuda", max_num_batched_tokens=64)
    assert (engine.runner.decode_graphs is None) == (
        family in {"deepseek", "deepseek_v2", "qwen3_moe"}
    )
    assert run_engine(engine, prompts) == reference


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize(
    ("family", "speculative"),
    [
        ("tiny", SpeculativeConfig(method="ngram", num_speculative_tokens=3)),
        ("deepseek", SpeculativeConfig(method="mtp", num_speculative_tokens=1)),
    ],
)
def test_speculation_on_cuda_keeps_the_greedy_tokens(
    family: str, speculative: SpeculativeConfig, request: pytest.FixtureRequest
) -> None:
    """Drafts verified on the GPU (prompt lookup next to decode graphs; DeepSeek's MTP module):
    the tokens of decoding without speculation, with drafts rejected (and, from prompt
    lookup, kept: a random MTP module rarely guesses right)."""
    model_dir = Path(request.getfixturevalue(f"{family}_model_dir"))
    prompts = repetitive_prompts([9, 30, 64, 130]) + prompts_of_lengths([17, 50], seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = run_engine(
        make_engine(model_dir, device="cuda", max_num_batched_tokens=64), prompts, params
    )
    engine = make_engine(
        model_dir, device="cuda", max_num_batched_tokens=64, speculative=speculative
    )
    assert run_engine(engine, prompts, params) == expected
    assert engine.stats.num_accepted_tokens < engine.stats.num_draft_tokens
    if speculative.method == "ngram":
        assert engine.stats.num_accepted_tokens > 0


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("family", ["tiny", "deepseek"])
def test_prefix_cache_on_cuda_reuses_pages_with_hf_tokens(
    family: str, request: pytest.FixtureRequest
) -> None:
    """Cached pages (plain and latent) reused on the GPU: a prompt sharing two full pages with an
    earlier one computes only the rest, and its tokens are HF's on the same GPU."""
    model_dir = Path(request.getfixturevalue(f"{family}_model_dir"))
    (system,) = prompts_of_lengths([40], seed=7)
    prompts = [system + suffix for suffix in prompts_of_lengths([9, 23], seed=8)]
    reference = [hf_greedy(model_dir, p, 8, device="cuda") for p in prompts]
    engine = make_engine(model_dir, device="cuda", enable_prefix_caching=True)
    page = engine.config.page_size
    assert run_engine(engine, prompts[:1]) == reference[:1]
    assert run_engine(engine, prompts[1:]) == reference[1:]
    assert engine.stats.num_prefix_cache_hits == 40 // page * page
