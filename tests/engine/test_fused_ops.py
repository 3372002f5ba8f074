"""The fused element-wise CPU ops (``torch.ops.pdserve.rms_norm``, ``add_rms_norm``,
``silu_mul``, ``rotate_``) against the PyTorch code they replace: bit for bit in bfloat16 (and
RoPE in float32), within a float32 rounding elsewhere; widths with and without a 16-lane tail,
strided views like the engine passes, the modules switching between both paths, and bad input
refused. The ops are called through the library on any CPU (the engine uses them on AVX-512
ones only), so these run wherever `make install` built it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from workers.engine import fused
from workers.engine.attention import cpu_kernel
from workers.engine.layers import MLP
from workers.engine.rms_norm import RMSNorm
from workers.engine.rope import RotaryTables

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ops() -> Any:
    assert cpu_kernel.LIBRARY.is_file(), "run `make install` to build the CPU kernels"
    torch.ops.load_library(str(cpu_kernel.LIBRARY))
    return torch.ops.pdserve


@pytest.fixture
def fused_on(ops: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused, "_ops", ops)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal in bfloat16; in float32 within a few units in the last place (sum order, exp)."""
    if got.dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [576, 100, 7])
def test_rms_norm_and_residual_add(ops: Any, dtype: torch.dtype, width: int) -> None:
    generator = torch.Generator().manual_seed(width)
    # Rows of a wider tensor: the op takes a row stride.
    wide = (torch.randn(37, width + 9, generator=generator) * 3).to(dtype)
    x = wide[:, :width]
    residual = torch.randn(37, width, generator=generator).to(dtype)
    weight = (torch.rand(width, generator=generator) + 0.5).to(dtype)
    out = torch.empty(37, width, dtype=dtype)
    ops.rms_norm(out, x, weight, 1e-5)
    assert_matches(out, torch_rms_norm(x, weight, 1e-5))

    total, normed = torch.empty_like(out), torch.empty_like(out)
    ops.add_rms_norm(total, normed, x, residual, weight, 1e-5)
    assert torch.equal(total, residual + x)  # one rounding of the sum, as `+` does
    assert_matches(normed, torch_rms_norm(residual + x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 40])
def test_silu_mul(ops: Any, dtype: torch.dtype, width: int) -> None:
    generator = torch.Generator().manual_seed(width)
    # Wide enough a range that e^-g over- and underflows at both ends.
    gate_up = (torch.randn(29, 2 * width, generator=generator) * 40).to(dtype)
    out = torch.empty(29, width, dtype=dtype)
    ops.silu_mul(out, gate_up)
    gate, up = gate_up.split(width, dim=-1)
    want = F.silu(gate) * up
    if dtype == torch.bfloat16:
        assert torch.equal(out, want)
    else:
        torch.testing.assert_close(out, want, rtol=4e-7, atol=1e-30)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 48, 100])
def test_rotate_in_place_equals_torch_bit_for_bit(
    ops: Any, dtype: torch.dtype, head_dim: int
) -> None:
    generator = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(11, 9 + 2 * 3, head_dim, generator=generator).to(dtype)
    cos = torch.randn(11, 1, head_dim, generator=generator).to(dtype)
    sin = torch.randn(11, 1, head_dim, generator=generator).to(dtype)
    values = qkv[:, 12:].clone()
    q_and_k = qkv[:, :12]  # the fused projection's q|k heads: a strided view
    want = q_and_k * cos + q_and_k.roll(head_dim // 2, dims=-1) * sin
    ops.rotate_(q_and_k, cos, sin)
    assert torch.equal(q_and_k, want)  # no FMA contraction: each product rounded, as torch's
    assert torch.equal(qkv[:, 12:], values)


def test_bad_input_is_refused(ops: Any) -> None:
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(torch.empty(4, 8), x, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="out must be"):
        ops.rms_norm(torch.empty(4, 9), x, torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.rms_norm(torch.empty(4, 8), x.double(), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        ops.rms_norm(torch.empty(4, 8).half(), x.half(), torch.ones(8).half(), 1e-5)
    with pytest.raises(RuntimeError, match="gate_up must be"):
        ops.silu_mul(torch.empty(4, 3), torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="cos and sin"):
        ops.rotate_(torch.randn(4, 2, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_modules_give_the_same_results_on_both_paths(
    ops: Any, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RMSNorm, its residual add, SwiGLU and RoPE as the layers call them, with the fused ops
    and with the PyTorch code (what every other device and dtype runs)."""
    generator = torch.Generator().manual_seed(1)
    norm = RMSNorm(96, 1e-6, dtype)
    norm.weight.copy_(torch.rand(96, generator=generator) + 0.5)
    config = SimpleNamespace(intermediate_size=80, hidden_size=96)
    mlp = MLP(config, dtype)  # type: ignore[arg-type]  # only the two sizes are read
    mlp.gate_up_proj_weight.copy_(torch.randn(160, 96, generator=generator) * 0.1)
    mlp.down_proj_weight.copy_(torch.randn(96, 80, generator=generator) * 0.1)
    x = torch.randn(13, 96, generator=generator).to(dtype)
    residual = torch.randn(13, 96, generator=generator).to(dtype)
    tables = RotaryTables(
        torch.randn(13, 1, 32, generator=generator).to(dtype),
        torch.randn(13, 1, 32, generator=generator).to(dtype),
    )
    heads = x.view(13, 3, 32)

    def run() -> list[torch.Tensor]:
        total, normed = norm.add_forward(x, residual)
        rotated = tables.rotate(heads.clone(), in_place=True)
        return [norm(x), total, normed, mlp(x), rotated, tables.rotate(heads)]

    monkeypatch.setattr(fused, "_ops", ops)
    assert fused.enabled()
    with_fused = run()
    monkeypatch.setattr(fused, "_ops", SimpleNamespace())
    assert not fused.enabled()
    without = run()
    for got, want in zip(with_fused, without, strict=True):
        assert_matches(got, want)


def test_switch_and_other_devices_fall_back(fused_on: None) -> None:
    x = torch.randn(3, 8, dtype=torch.float64)
    assert fused.rms_norm(x, torch.ones(8, dtype=torch.float64), 1e-5) is None
    assert fused.silu_mul(torch.randn(3, 8, dtype=torch.float16)) is None
    assert fused.rms_norm(torch.randn(3, 8), torch.ones(8), 1e-5) is not None


def test_environment_switch_turns_them_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused, "_ops", None)
    monkeypatch.setenv(fused.ENV_SWITCH, "0")
    assert not fused.enabled()
    assert fused.rms_norm(torch.randn(3, 8), torch.ones(8), 1e-5) is None
