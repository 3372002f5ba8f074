"""Cost models: the roofline presets' basic shape, the calibrated fit's round trip, the
calibrations refused (step times that are not finite positive seconds), and the points a
calibration can measure."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from orchestrator.cli.main import main
from orchestrator.sim.calibrate import BUDGET, check_options
from orchestrator.sim.calibrated import fit, from_spec, load, mixed_errors
from orchestrator.sim.cost import (
    StepShape,
    create_cost_model,
    decode_seconds,
    exposed_transfer_seconds,
    prefill_seconds,
)
from orchestrator.sim.emit import PAGE_SIZE
from orchestrator.sim.hardware import GPUS
from orchestrator.sim.instances import chunk_tokens
from orchestrator.sim.roofline import RooflineCostModel
from tests.sim.test_cli import SIMULATE


def test_calibrated_fit_recovers_the_coefficients_it_was_measured_with(tmp_path: Path) -> None:
    truth_p, truth_d = (0.004, 2e-5, 3e-9), (0.003, 1e-4, 2e-7)
    prefill = [
        {"tokens": n, "context": c, "seconds": truth_p[0] + truth_p[1] * n + truth_p[2] * (n * c + n * (n + 1) // 2)}
        for n, c in [(32, 0), (128, 0), (512, 0), (512, 512), (512, 1536)]
    ]  # fmt: skip
    decode = [
        {"batch": b, "kv_tokens": kv, "seconds": truth_d[0] + truth_d[1] * b + truth_d[2] * kv}
        for b, kv in [(1, 100), (4, 1000), (16, 2000), (32, 9000)]
    ]
    transfer = [{"bytes": s, "seconds": 1e-4 + s / 5e9} for s in (1 << 16, 1 << 20, 1 << 24)]
    data = {
        "num_layers": 6, "kv_bytes_per_token": 12288, "kv_capacity_tokens": 4096,
        "prefill": prefill, "decode": decode, "transfer": transfer,
    }  # fmt: skip
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(data))
    model = from_spec([str(path)])
    assert model.prefill_coefficients == pytest.approx(truth_p, rel=1e-6)
    assert model.decode_coefficients == pytest.approx(truth_d, rel=1e-6)
    assert model.transfer_coefficients == pytest.approx((1e-4, 1 / 5e9), rel=1e-6)
    assert prefill_seconds(model, 512, 512, 1) == pytest.approx(prefill[3]["seconds"])
    assert decode_seconds(model, 4, 1000, 1) == pytest.approx(decode[1]["seconds"])
    assert model.kv_capacity_tokens(2) == 8192


def test_calibrated_fit_keeps_coefficients_non_negative() -> None:
    noisy = {
        "num_layers": 2, "kv_bytes_per_token": 8, "kv_capacity_tokens": 100,
        "prefill": [{"tokens": n, "context": 0, "seconds": 0.01 + 1e-4 * n} for n in (8, 16, 32, 64)],
        "decode": [{"batch": b, "kv_tokens": kv, "seconds": s}
                   for b, kv, s in [(1, 10, 0.02), (2, 400, 0.021), (4, 40, 0.023), (8, 80, 0.027)]],
    }  # fmt: skip
    model = fit(noisy)
    assert min(model.decode_coefficients) >= 0 and min(model.prefill_coefficients) >= 0
    assert model.transfer_coefficients == (0.0, 0.0)


def test_roofline_prefill_is_compute_bound_and_decode_memory_bound() -> None:
    llama = create_cost_model("roofline:llama-3-70b:h100")
    assert isinstance(llama, RooflineCostModel)
    # 8k-token prefill ~ 2 * 70.6e9 * 8192 FLOP over 4 GPUs at 50% MFU: ~0.58 s plus attention.
    assert 0.5 < prefill_seconds(llama, 8192, 0, 4) < 1.0
    # Batch-1 decode ~ 141 GB of BF16 weights over 4 x 3.35 TB/s x 0.7: ~15 ms.
    assert 0.012 < decode_seconds(llama, 1, 1000, 4) < 0.02
    # Weights do not fit on one 85.5 GB (80 GiB) GPU; they do on two.
    assert not llama.supports_tp(1) and llama.supports_tp(2)
    assert not llama.supports_tp(16)  # beyond a node


def test_roofline_is_monotone_and_h200_decodes_faster_than_h100() -> None:
    h100 = create_cost_model("roofline:qwen3-coder-480b:h100")
    h200 = create_cost_model("roofline:qwen3-coder-480b:h200")
    shapes = [StepShape(num_decode_seqs=b, num_decode_kv_tokens=b * 4000) for b in (1, 8, 64)]
    times = [h200.step_seconds(shape, 8) for shape in shapes]
    assert times == sorted(times)
    assert all(h200.step_seconds(s, 8) < h100.step_seconds(s, 8) for s in shapes)
    mixed = StepShape(2048, 2048 * 1024, 32, 32 * 4000)
    assert h200.step_seconds(mixed, 8) > h200.step_seconds(shapes[1], 8)


def test_mla_replicates_kv_and_layerwise_push_hides_all_but_the_last_layer() -> None:
    r1 = create_cost_model("roofline:deepseek-r1:h200:8x400g")
    assert r1.kv_bytes(1) == 61 * 576 * 2  # one latent + rope key per layer, BF16
    # Replicated latent: (150.75 GB x 0.9 - 671 GB / 8) per rank over 70 KB per token, ~737k
    # (the H200 reports 143771 MiB, not the 141e9 bytes this once assumed: ~612k).
    assert 700_000 < r1.kv_capacity_tokens(8) < 780_000
    assert not r1.supports_tp(4)  # 671 GB of FP8 weights need a full H200 node
    assert exposed_transfer_seconds(0.061, overlap=1.0, num_layers=61) == pytest.approx(0.001)
    # A link slower than the compute exposes what the compute cannot hide.
    assert exposed_transfer_seconds(2.0, overlap=1.0, num_layers=2) == pytest.approx(1.5)


@pytest.mark.parametrize(
    "spec",
    [
        "roofline:gpt-5:h100",
        "roofline:llama-3-70b",
        "nope:x",
        "calibrated:",
        "roofline:llama-3-70b:h100:mfu=2",
    ],
)
def test_bad_specs_are_rejected(spec: str) -> None:
    with pytest.raises(ValueError):
        create_cost_model(spec)


@pytest.mark.slow
def test_calibration_runs_our_engine_and_its_output_fits(tmp_path: Path) -> None:
    from orchestrator.sim.calibrate import run_calibration

    out = tmp_path / "calibration.json"
    data = run_calibration(
        out,
        prefill_sizes=(16, 64),
        decode_batches=(1, 2, 4),
        repeats=1,
        budget=64,
        prefill_context=320,
    )
    assert json.loads(out.read_text()) == data
    assert data["num_layers"] == 6 and data["kv_capacity_tokens"] > 0
    assert len(data["decode"]) >= 3
    # One-shot prompts, then the 320-token prompt's chunks after 64..256 tokens of context.
    shapes = [(p["tokens"], p["context"]) for p in data["prefill"]]
    assert shapes == [(16, 0), (64, 0), (64, 64), (64, 128), (64, 192), (64, 256)]
    assert all(point["seconds"] > 0 for point in data["prefill"] + data["decode"])
    model = from_spec([str(out)])
    assert decode_seconds(model, 4, 4 * 40, 1) > 0


@pytest.mark.slow
def test_calibration_sizes_its_pool_for_the_points_it_is_asked(tmp_path: Path) -> None:
    from orchestrator.sim.calibrate import run_calibration

    # One decode batch and no mixed points.
    data = run_calibration(
        tmp_path / "a.json", prefill_sizes=(16,), decode_batches=(1,), repeats=1, budget=64
    )
    assert {p["batch"] for p in data["decode"]} == {1} and "mixed" not in data
    # Mixed points whose 16 decoders (768-token prompts, room for 1024 more tokens each) and
    # prompt need far more pages than the decode points: the pool holds them all, so the
    # prompt is not held back (it was, and the calibration failed).
    data = run_calibration(
        tmp_path / "b.json",
        prefill_sizes=(16,),
        decode_batches=(1,),
        repeats=1,
        budget=256,
        mixed_batches=(16,),
    )
    assert data["kv_capacity_tokens"] >= 16 * (768 + 1024) + 768
    assert {p["batch"] for p in data["mixed"]} == {16}


def _fit_data() -> dict[str, Any]:
    return {
        "num_layers": 6, "kv_bytes_per_token": 12288, "kv_capacity_tokens": 16384,
        "prefill": [{"tokens": n, "context": c, "seconds": 0.01 + 3e-4 * n + 1e-7 * (n * c + n * (n + 1) // 2)}
                    for n, c in [(32, 0), (128, 0), (256, 0), (256, 512)]],
        "decode": [{"batch": b, "kv_tokens": kv, "seconds": 0.006 + 3e-4 * b + 6e-6 * kv}
                   for b, kv in [(1, 40), (8, 300), (8, 6000), (32, 26000)]],
    }  # fmt: skip


def test_the_fit_reads_request_overheads_and_token_delays_and_defaults_them_to_zero() -> None:
    data = _fit_data()
    assert fit(data).request_overhead_seconds(True) == 0.0
    data["overheads"] = {"from": "run.json", "disaggregated_s": 0.09, "mixed_s": 0.05}
    model = fit(data)
    assert model.request_overhead_seconds(True) == pytest.approx(0.09)
    assert model.request_overhead_seconds(False) == pytest.approx(0.05)
    assert model.token_delay_seconds(True) == model.token_delay_seconds(False) == 0.0
    data["overheads"].update(disaggregated_token_s=0.0007, mixed_token_s=0.001)
    model = fit(data)
    assert model.token_delay_seconds(True) == pytest.approx(0.0007)
    assert model.token_delay_seconds(False) == pytest.approx(0.001)
    assert model.without_overheads().token_delay_s == (0.0, 0.0)
    assert model.without_overheads().request_overhead_s == (0.0, 0.0)
    for key in ("mixed_s", "mixed_token_s"):
        with pytest.raises(ValueError, match=">= 0"):
            fit({**data, "overheads": {**data["overheads"], key: -0.01}})
    roofline = create_cost_model("roofline:llama-3-70b:h100")
    assert roofline.request_overhead_seconds(True) == roofline.token_delay_seconds(True) == 0.0


def test_mixed_points_are_checked_against_the_fits_mixed_step_price() -> None:
    data = _fit_data()
    model = fit(data)
    assert mixed_errors(model, data) == []
    # Points priced exactly as the model prices a chunk step with decodes: zero error. The
    # model's decode term counts the token each sequence feeds (+ batch), the points do not.
    shapes = [(4, 3100, 240, 0), (16, 12400, 240, 480)]
    exact = [
        model.step_seconds(StepShape(t, t * c + t * (t + 1) // 2, b, kv + b), 1)
        for b, kv, t, c in shapes
    ]
    data["mixed"] = [
        {"batch": b, "kv_tokens": kv, "tokens": t, "context": c, "seconds": s}
        for (b, kv, t, c), s in zip(shapes, exact, strict=True)
    ]
    assert mixed_errors(model, data) == pytest.approx([0.0, 0.0], abs=1e-9)
    for point in data["mixed"]:
        point["seconds"] *= 2  # a real step twice as slow as priced: the fit under-predicts
    assert mixed_errors(model, data) == pytest.approx([-0.5, -0.5])


def test_calibration_refuses_a_bad_process_count_before_measuring(tmp_path: Path) -> None:
    from orchestrator.sim.calibrate import run_calibration

    with pytest.raises(ValueError, match="concurrent"):
        run_calibration(tmp_path / "c.json", concurrent=0)
    with pytest.raises(ValueError, match="prefill_context"):
        run_calibration(tmp_path / "c.json", budget=256, prefill_context=300)
    with pytest.raises(ValueError, match="background"):
        run_calibration(tmp_path / "c.json", concurrent=2, background=(4000, 200))
    assert not (tmp_path / "c.json").exists()


@pytest.mark.slow
def test_calibration_under_contention_and_its_mixed_points(tmp_path: Path) -> None:
    # One background engine process steps while this one measures; the mixed points are
    # chunk steps that carried every decoder of their batch.
    from orchestrator.sim.calibrate import run_calibration

    data = run_calibration(
        tmp_path / "c.json",
        prefill_sizes=(16,),
        decode_batches=(1, 2),
        repeats=1,
        budget=64,
        concurrent=2,
        mixed_batches=(2,),
        mixed_context=96,
        background=(96, 8),  # short rounds: mostly prefill chunks
    )
    assert data["contention"]["processes"] == 2
    assert data["contention"]["background"] == "4 requests x 96 prompt + 8 output tokens"
    assert len(data["alone"]["prefill"]) == len(data["prefill"])  # measured both ways
    assert fit(data).alone_coefficients is not None
    mixed = data["mixed"]
    # 96 prompt tokens in the 62 tokens left by 2 decodes: page-aligned chunks of 48 + 48.
    assert [p["batch"] for p in mixed] == [2, 2]
    assert [p["tokens"] for p in mixed] == [48, 48] and [p["context"] for p in mixed] == [0, 48]
    assert all(p["kv_tokens"] >= 2 * 96 and p["seconds"] > 0 for p in mixed)
    assert len(mixed_errors(fit(data), data)) == 2


def test_chunks_follow_the_schedulers_page_aligned_rule() -> None:
    from orchestrator.sim.instances import chunk_tokens

    assert chunk_tokens(0, 768, 252, 16) == 240  # 4 decodes leave 252: the chunk ends on a page
    assert chunk_tokens(720, 48, 252, 16) == 48  # the rest fits: all of it
    assert chunk_tokens(0, 768, 10, 16) == 0  # less than a page left: nothing this step


def test_a_calibration_under_contention_prices_steps_by_how_many_others_step() -> None:
    data = _fit_data()
    slow = [dict(p, seconds=2 * p["seconds"]) for p in data["prefill"]]
    data["alone"] = {"prefill": data["prefill"], "decode": data["decode"]}
    data["prefill"] = slow
    data["decode"] = [dict(p, seconds=3 * p["seconds"]) for p in data["decode"]]
    data["contention"] = {"processes": 3}
    model = fit(data)
    chunk, batch = (
        StepShape(256, 256 * 257 // 2),
        StepShape(num_decode_seqs=8, num_decode_kv_tokens=6000),
    )
    alone = prefill_seconds(fit(_fit_data()), 256, 0, 1)
    assert model.step_seconds(chunk, 1) == pytest.approx(alone)  # nobody else stepping
    assert model.step_seconds(chunk, 1, busy_others=("mixed",)) == pytest.approx(
        1.5 * alone
    )  # 1 of 2
    assert model.step_seconds(chunk, 1, busy_others=("mixed",) * 2) == pytest.approx(2 * alone)
    assert model.step_seconds(chunk, 1, busy_others=("mixed",) * 5) == pytest.approx(
        2 * alone
    )  # at most
    assert model.step_seconds(batch, 1, ("mixed",) * 2) == pytest.approx(
        3 * model.step_seconds(batch, 1)
    )
    # Without the fits measured alone, the contended fit prices every step.
    del data["alone"]
    assert fit(data).step_seconds(chunk, 1) == pytest.approx(2 * alone)


def test_gpu_memory_is_what_the_device_reports() -> None:
    # nvidia-smi memory.total: 81559 MiB on an H100 80GB HBM3, 143771 MiB on an H200.
    assert GPUS["h100"].hbm_bytes == 81559 * 2**20  # 85.5e9 bytes, not 80e9
    assert GPUS["h200"].hbm_bytes == 143771 * 2**20  # 150.75e9 bytes, not 141e9


def _calibration_text(**changes: Any) -> str:
    data = _fit_data()
    for key, value in changes.items():
        data[key] = value
    return json.dumps(data)  # NaN and Infinity as JSON's extensions, as json.loads reads them


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            _calibration_text(
                prefill=[{**point, "seconds": math.nan} for point in _fit_data()["prefill"]]
            ),
            "must be finite",
        ),
        (
            _calibration_text(
                decode=[{**point, "seconds": math.inf} for point in _fit_data()["decode"]]
            ),
            "must be finite",
        ),
        (_calibration_text(overheads={"disaggregated_s": math.nan}), "must be a finite number"),
        # 1e400 is a float's infinity once read: `int` of it raised OverflowError.
        (_calibration_text(kv_bytes_per_token=12345.5).replace("12345.5", "1e400"), "finite"),
        (_calibration_text(num_layers=math.inf), "num_layers must be a finite number"),
        (
            _calibration_text(
                decode=[{**point, "seconds": -1.0} for point in _fit_data()["decode"]]
            ),
            "prices a decode step at 0",
        ),
    ],
    ids=["nan-seconds", "inf-seconds", "nan-overhead", "huge-kv-bytes", "inf-layers", "negative"],
)
def test_calibrations_that_are_not_finite_positive_step_times_are_refused(
    text: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "calibration.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load(path)
    assert main([*SIMULATE, "--cost", f"calibrated:{path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pdserve simulate: {path}: ") and err.count("\n") == 1


def test_mixed_batches_must_leave_a_page_for_the_chunk() -> None:
    most = BUDGET - PAGE_SIZE
    # The bound is exact: one more decode leaves no page-aligned chunk, and the point never ends.
    assert chunk_tokens(0, 768, BUDGET - most, PAGE_SIZE) == PAGE_SIZE
    assert chunk_tokens(0, 768, BUDGET - most - 1, PAGE_SIZE) == 0
    check_options(1, None, BUDGET, mixed_batches=(4, most))
    for bad in ((most + 1,), (0, 4), (BUDGET,)):
        with pytest.raises(ValueError, match=f"mixed batches must be 1..{most}"):
            check_options(1, None, BUDGET, mixed_batches=bad)
    with pytest.raises(ValueError, match="decode batches must be >= 1"):
        check_options(1, None, BUDGET, decode_batches=(0, 8))
    with pytest.raises(ValueError, match="decode contexts must be >= 1"):
        check_options(1, None, BUDGET, decode_contexts=(0,))


@pytest.mark.slow
def test_calibration_of_the_deepseek_preset_prices_mla_pages(tmp_path: Path) -> None:
    from orchestrator.sim.calibrate import run_calibration
    from workers.engine.model_config import ModelConfig
    from workers.engine.presets import preset_config

    out = tmp_path / "calibration.json"
    data = run_calibration(
        out,
        prefill_sizes=(16, 64),
        decode_batches=(1, 2, 4),
        repeats=1,
        budget=64,
        prefill_context=192,
        preset="deepseek-tiny",
    )
    config = ModelConfig.from_dict(preset_config("deepseek-tiny"))
    assert data["model"] == "deepseek-tiny" and data["num_layers"] == config.num_layers
    # One latent (and rope key) per token and layer, float32: not K and V per head.
    assert data["kv_bytes_per_token"] == config.kv_page_bytes(1, 4)
    assert all(point["seconds"] > 0 for point in data["prefill"] + data["decode"])
    assert decode_seconds(from_spec([str(out)]), 4, 4 * 40, 1) > 0


def test_calibration_refuses_an_unknown_preset_before_measuring() -> None:
    with pytest.raises(ValueError, match="unknown preset"):
        check_options(1, None, BUDGET, preset="no-such-model")
