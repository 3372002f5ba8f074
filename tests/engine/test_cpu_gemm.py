"""Projection weights packed for oneDNN at load (`workers.engine.cpu_gemm`): the same products
as plain weights, the same greedy tokens, the switch that turns it off, and row counts
bucketed so that oneDNN's kernels per shape stay few."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from workers.engine import cpu_gemm
from workers.engine.cpu_gemm import (
    ENV_SWITCH,
    EXACT_ROWS,
    FLOAT32_COPY,
    can_prepack,
    dense,
    linear,
    native_half,
    pack,
    row_bucket,
)
from workers.engine.layers import DecoderLayer
from workers.engine.llm import LLM
from workers.engine.loader import load_model
from workers.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN"
)


@pytest.mark.parametrize("rows", [0, 1, 16, 300, 1100])
def test_packed_linear_equals_plain(rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=generator)
    bias = torch.randn(96, generator=generator)
    x = torch.randn(rows, 64, generator=generator)[:, :40]  # a strided input, as a split gives
    packed = pack(weight)
    assert packed.is_mkldnn and packed.shape == weight.shape
    assert torch.equal(dense(packed), weight)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, packed, bias), F.linear(x, weight, bias))
        assert torch.equal(linear(x, weight, bias), F.linear(x, weight, bias))


def test_row_counts_fall_into_few_buckets_a_few_percent_up() -> None:
    buckets = {row_bucket(rows) for rows in range(1, 16385)}
    assert all(row_bucket(rows) == rows for rows in range(EXACT_ROWS + 1))
    for rows in range(EXACT_ROWS + 1, 16385):
        assert rows <= row_bucket(rows) <= max(rows + 31, rows * 33 / 32), rows
        assert row_bucket(row_bucket(rows)) == row_bucket(rows)  # a bucket is its own
    assert len(buckets) < EXACT_ROWS + 200  # 16384 counts, ~32 sizes an octave


def test_the_first_row_counts_met_run_exact_and_later_ones_in_buckets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpu_gemm, "_exact_counts", set())
    monkeypatch.setattr(cpu_gemm, "MAX_EXACT_COUNTS", 2)
    assert [cpu_gemm._run_rows(rows) for rows in (100, 30, 101, 102, 100, 1700)] == [
        100, 30, 101, 128, 100, 1728,
    ]  # fmt: skip
    # The products are the same either way.
    weight = torch.randn(96, 40)
    x = torch.randn(102, 40)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, pack(weight)), F.linear(x, weight))


def test_many_row_counts_leave_memory_flat(monkeypatch: pytest.MonkeyPatch) -> None:
    # oneDNN keeps a kernel (~0.5 MB) for every GEMM shape it builds: 300 row counts held
    # ~160 MB unbucketed, ~5 MB in buckets (module docstring). Every count past the exact
    # ones a process allows goes to a bucket: here, from the first.
    monkeypatch.setattr(cpu_gemm, "MAX_EXACT_COUNTS", 0)
    mallinfo = _mallinfo2()
    weight = pack(torch.randn(128, 64))
    with torch.inference_mode():
        x = torch.randn(400, 64)
        before = mallinfo()
        for rows in range(100, 400):
            out = linear(x[:rows], weight)
        grown = mallinfo() - before
    assert out.shape == (399, 128)
    assert grown < 40 * 2**20, f"{grown / 2**20:.0f} MB held after 300 row counts"


def _mallinfo2() -> Callable[[], int]:
    """Bytes glibc's malloc has handed out and not had back (``mallinfo2().uordblks``)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        function = libc.mallinfo2
    except (OSError, AttributeError):
        pytest.skip("needs glibc 2.33 or newer (mallinfo2)")
    fields = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks")

    class Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (*fields, "fordblks", "keepcost")]

    function.restype = Info
    return lambda: int(function().uordblks)


def test_what_is_packed() -> None:
    assert can_prepack(torch.zeros(4, 4))
    assert not can_prepack(torch.zeros(4))  # norms and biases stay plain
    assert can_prepack(torch.zeros(4, 4, dtype=torch.bfloat16))
    assert can_prepack(torch.zeros(4, 4, dtype=torch.float16))
    assert not can_prepack(torch.zeros(4, 4, dtype=torch.int8))
    assert not can_prepack(pack(torch.zeros(4, 4)))
    assert not can_prepack(pack(torch.zeros(4, 4, dtype=torch.bfloat16)))


def _half_precision_case(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(96, 40, generator=generator).to(dtype)
    x = torch.randn(16, 40, generator=generator).to(dtype)
    return weight, x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_weight_without_native_dot_products(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows >= 2 run in float32 on the weight's float32 copy, one row on the weight itself."""
    # A fake of a CPU without half-precision dot products (AVX2 only), wherever this runs.
    monkeypatch.setattr(cpu_gemm, "native_half", lambda dtype: False)
    weight, x = _half_precision_case(dtype)
    bias = torch.randn(96).to(dtype)
    packed = pack(weight)
    assert not packed.is_mkldnn and packed.dtype == dtype and torch.equal(dense(packed), weight)
    copy = getattr(packed, FLOAT32_COPY)
    assert copy.is_mkldnn and copy.dtype == torch.float32
    assert torch.equal(copy.to_dense(), weight.float())
    with torch.inference_mode():
        out = linear(x, packed, bias)
        # A float32 GEMM of the half-precision values, rounded once at the end (to within a
        # rounding: two float32 GEMMs may sum in different orders).
        expected = F.linear(x.float(), weight.float(), bias.float())
        assert out.dtype == dtype
        torch.testing.assert_close(out, expected.to(dtype))
        assert torch.equal(linear(x[:1], packed, bias), F.linear(x[:1], weight, bias))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_weight_on_this_cpu(dtype: torch.dtype) -> None:
    weight, x = _half_precision_case(dtype)
    packed = pack(weight)
    assert packed.is_mkldnn == native_half(dtype)
    assert hasattr(packed, FLOAT32_COPY) == (not native_half(dtype))
    assert packed.dtype == dtype and torch.equal(dense(packed), weight)
    with torch.inference_mode():
        for rows in (x[:1], x):
            out = linear(rows, packed)
            assert out.dtype == dtype
            torch.testing.assert_close(out, F.linear(rows.float(), weight.float()).to(dtype))


def test_load_packs_projections_and_keeps_the_embedding_plain(tiny_model_dir: Path) -> None:
    model, _ = load_model(tiny_model_dir, "float32")
    layer = model.layers[0]
    assert isinstance(layer, DecoderLayer)
    for weight in (
        layer.self_attn.qkv_proj_weight,
        layer.self_attn.o_proj_weight,
        layer.mlp.gate_up_proj_weight,
        layer.mlp.down_proj_weight,
        model.lm_head,
    ):
        assert weight.is_mkldnn
    assert not model.embed_tokens.is_mkldnn and not layer.input_layernorm.weight.is_mkldnn
    plain, _ = load_model(tiny_model_dir, "float32", prepack=False)
    assert not any(p.is_mkldnn for p in plain.parameters())
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model.compute_logits(hidden), plain.compute_logits(hidden))


def test_switch_off_keeps_plain_weights(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_SWITCH, "0")
    model, _ = load_model(tiny_model_dir, "float32")
    assert not any(p.is_mkldnn for p in model.parameters())


def test_greedy_tokens_match_plain_weights(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = [[1, 5, 9, 200, 31, 7], list(range(3, 70))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    packed = [o.token_ids for o in LLM(tiny_model_dir, dtype="float32").generate(prompts, params)]
    monkeypatch.setenv(ENV_SWITCH, "0")
    plain = [o.token_ids for o in LLM(tiny_model_dir, dtype="float32").generate(prompts, params)]
    assert packed == plain
