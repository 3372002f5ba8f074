"""``pdserve calibrate``: measure our engine (and optionally the fabric) on this machine and
write the JSON that `calibrated.fit` reads.

The engine runs a preset (``small`` by default; ``deepseek-tiny`` to price MLA and MoE steps
as our engine runs them; random weights: only shapes matter for time) in mixed role, one
process, one rank. Prefill points: one-shot prompts up to the token budget, then
one long prompt (``prefill_context`` tokens) in budget-sized chunks (so that the attention term
sees context up to the workload's longest prompts). Decode
points: batches of short prompts (and, with ``decode_contexts``, of longer ones, so that the
fit sees the per-KV-token cost), timing only steps that run after every sequence has its
first token and before any finishes (pure decode steps of the whole batch). Each point is the median of its repeats, after a warm-up.
Fabric points: one write of each size between two transfer engines in this process over
``tcp;ofi_rxm`` on loopback, submit to the target's counter firing.

Contention (``concurrent`` > 1): the runs this calibration predicts have several engine
processes (the cluster's workers) stepping on the same cores, so the measuring engine can be
timed while ``concurrent - 1`` background engine processes step without pause. Each serves
rounds of `BACKGROUND_BATCH` requests of ``background_prompt`` tokens (prefilled in chunks)
and ``background_output`` new tokens: by default a decode worker with the few long requests of
the record workload (768 / 256); a prefill-heavy workload is better matched by its own mean
prompt and output, since chunk steps contend for the cores differently from decode steps.
The prefill and decode points are
measured twice: alone first (under ``"alone"``), then with the background engines (the main
``"prefill"`` / ``"decode"``, and the mixed points); ``"contention"`` records the setup.
`calibrated.fit` prices a step between the two by how many other instances are stepping.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orchestrator.sim.instances import chunk_tokens
from workers.log import progress

logger = logging.getLogger(__name__)

BUDGET = 256  # prefill chunk / step token budget of the calibration engine (default)
PAGE_SIZE = 16  # tokens per KV page of the calibration engine (`EngineConfig`'s default)
PROMPT_LEN = 32  # decode points: prompt tokens per sequence (default; see decode_contexts)
DECODE_STEPS = 4  # timed decode steps per batch size
MIXED_MAX_TOKENS = 1024  # a mixed point's decoders: tokens each (KV reserved at admission)
BACKGROUND_BATCH = 4  # each background engine: rounds of this many requests ...
BACKGROUND_PROMPT = 768  # ... of prompts this long (default: the record workload's mean) ...
BACKGROUND_OUTPUT = 256  # ... and this many new tokens
BACKGROUND_START_S = 300.0  # a background engine builds and warms up within this


def _engine(model_dir: Path, max_batch: int, budget: int, num_pages: int = 256) -> Any:
    from workers.engine.config import EngineConfig
    from workers.engine.engine_core import EngineCore

    config = EngineConfig(
        role="mixed",
        max_num_seqs=max_batch,
        max_num_batched_tokens=budget,
        num_pages=max(num_pages, max_batch * 4),
    )
    return EngineCore(model_dir, config, detokenize=False)


def _timed_steps(engine: Any) -> list[float]:
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def _prefill_points(
    engine: Any, sizes: Sequence[int], repeats: int, long_prompt: int
) -> list[dict[str, float]]:
    budget = engine.config.max_num_batched_tokens
    from workers.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    shapes = [(n, 0) for n in sizes if n <= budget]
    shapes += [(budget, context) for context in range(budget, long_prompt, budget)]
    samples: dict[tuple[int, int], list[float]] = {shape: [] for shape in shapes}
    for repeat in range(repeats + 1):  # the first round warms up
        for n in sorted({n for n, _ in shapes if _ == 0}):
            engine.add_request(f"p{repeat}-{n}", [5] * n, params)
            times = _timed_steps(engine)
            if repeat:
                samples[(n, 0)].append(times[0])
        engine.add_request(f"long{repeat}", [7] * long_prompt, params)
        times = _timed_steps(engine)
        if repeat:
            for i, context in enumerate(range(budget, long_prompt, budget), 1):
                samples[(budget, context)].append(times[i])
    return [
        {"tokens": n, "context": c, "seconds": statistics.median(t)}
        for (n, c), t in samples.items()
    ]


def _decode_points(
    engine: Any, batches: Sequence[int], repeats: int, prompt_len: int = PROMPT_LEN
) -> list[dict[str, float]]:
    points = []
    for batch in [batches[0], *batches]:  # the first, repeated, warms up
        samples: list[list[float]] = [[] for _ in range(DECODE_STEPS)]
        kv_tokens = [0] * DECODE_STEPS
        for repeat in range(repeats):
            timed = _decode_run(engine, batch, f"d{prompt_len}-{batch}-{repeat}", prompt_len)
            for k, (seconds, kv) in enumerate(timed):
                samples[k].append(seconds)
                kv_tokens[k] = kv
        points += [
            {"batch": batch, "kv_tokens": kv_tokens[k], "seconds": statistics.median(s)}
            for k, s in enumerate(samples)
            if s
        ]
    return points[DECODE_STEPS:]


def _decode_max_tokens(batch: int, prompt_len: int, budget: int) -> int:
    # Early sequences decode while later ones prefill: enough tokens that none finishes
    # before the timed steps end.
    return 2 * (batch * prompt_len // max(1, budget - batch) + 2) + DECODE_STEPS


def _decode_run(
    engine: Any, batch: int, prefix: str, prompt_len: int = PROMPT_LEN
) -> list[tuple[float, int]]:
    """(seconds, KV tokens read) of the first DECODE_STEPS steps after every sequence has its
    first token: pure decode steps of exactly ``batch`` sequences of ``prompt_len``-token
    prompts."""
    from workers.engine.sampling_params import SamplingParams

    budget = engine.config.max_num_batched_tokens
    max_tokens = _decode_max_tokens(batch, prompt_len, budget)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    generated: dict[str, int] = {}
    for i in range(batch):
        engine.add_request(f"{prefix}-{i}", [9] * prompt_len, params)
    timed: list[tuple[float, int]] = []
    while engine.has_unfinished():
        is_pure_decode = len(generated) == batch and len(timed) < DECODE_STEPS
        # Each sequence feeds its last token and attends to the prompt and every output.
        kv = sum(prompt_len + n for n in generated.values())
        start = time.perf_counter()
        outputs = engine.step()
        if is_pure_decode:
            timed.append((time.perf_counter() - start, kv))
        for output in outputs:
            if output.new_token_ids:
                generated[output.request_id] = generated.get(output.request_id, 0) + len(
                    output.new_token_ids
                )
    return timed


def _mixed_points(
    engine: Any, batches: Sequence[int], context: int, repeats: int
) -> list[dict[str, float]]:
    """Chunk steps with decodes in them (a colocated worker's stall): ``batch`` sequences of
    ``context``-token prompts decode while one more ``context``-token prompt is prefilled in
    chunks that fill the rest of the budget. Only the steps that carry both are kept; each
    point's shape says what ran, so the cost model's prediction for it can be checked."""
    from workers.engine.sampling_params import SamplingParams

    budget = engine.config.max_num_batched_tokens
    points = []
    for warm_up, batch in [(True, batches[0]), *((False, b) for b in batches)]:
        samples: dict[int, list[float]] = {}  # chunk index -> seconds
        shapes: dict[int, tuple[int, int, int]] = {}  # chunk index -> (KV read, tokens, context)
        for repeat in range(repeats):
            decode_params = SamplingParams(
                temperature=0.0, max_tokens=MIXED_MAX_TOKENS, ignore_eos=True
            )
            prefix = f"m{batch}-{repeat}-{warm_up}"
            for i in range(batch):
                engine.add_request(f"{prefix}-{i}", [13] * context, decode_params)
            generated: dict[str, int] = {}
            while len(generated) < batch:  # until every decoder has its first token
                for output in engine.step():
                    if output.new_token_ids:
                        count = generated.get(output.request_id, 0)
                        generated[output.request_id] = count + len(output.new_token_ids)
            engine.add_request(f"{prefix}-p", [15] * context, SamplingParams(max_tokens=1))
            prefilled, chunk = 0, 0
            while prefilled < context:
                take = chunk_tokens(
                    prefilled, context - prefilled, budget - batch, engine.config.page_size
                )
                # Each decoder reads its prompt, its outputs and the token it feeds.
                kv = sum(context + n for n in generated.values())
                start = time.perf_counter()
                outputs = engine.step()
                samples.setdefault(chunk, []).append(time.perf_counter() - start)
                shapes[chunk] = (kv, take, prefilled)
                prefilled, chunk = prefilled + take, chunk + 1
                for output in outputs:
                    if output.request_id in generated and output.new_token_ids:
                        generated[output.request_id] += len(output.new_token_ids)
            # Its one token ends the prompt: had the scheduler held the prompt back (no
            # room), the steps timed were not the chunk steps they are recorded as.
            if not any(o.request_id == f"{prefix}-p" and o.new_token_ids for o in outputs):
                raise RuntimeError(f"mixed point {prefix}: the prompt did not finish on time")
            for i in range(batch):
                engine.abort(f"{prefix}-{i}")
            while engine.has_unfinished():
                engine.step()
        if not warm_up:
            points += [
                {
                    "batch": batch,
                    "kv_tokens": shapes[k][0],
                    "tokens": shapes[k][1],
                    "context": shapes[k][2],
                    "seconds": statistics.median(s),
                }
                for k, s in samples.items()
            ]
    return points


def _fabric_points(sizes: Sequence[int], repeats: int) -> list[dict[str, float]]:
    import numpy as np

    from workers.fabric import TransferEngine

    target, initiator = TransferEngine("tcp;ofi_rxm"), TransferEngine("tcp;ofi_rxm")
    try:
        region = max(sizes)
        _, descriptor = target.register(np.zeros(region, dtype=np.uint8))
        source, _ = initiator.register(np.ones(region, dtype=np.uint8))
        peer = initiator.add_peer(target.address)
        points = []
        imm = 1
        for size in [sizes[0], *sizes]:
            samples = []
            for _ in range(repeats):
                landed = threading.Event()
                target.expect_imm(imm, 1, on_reached=landed.set)
                start = time.perf_counter()
                initiator.submit_write(source, 0, peer, descriptor, 0, size, imm=imm)
                if not landed.wait(30):
                    raise TimeoutError(f"a {size}-byte loopback write did not land in 30 s")
                samples.append(time.perf_counter() - start)
                imm += 1
            points.append({"bytes": size, "seconds": statistics.median(samples)})
        return points[1:]  # the first size was a warm-up
    finally:
        initiator.close()
        target.close()


def _background_engine(
    model_dir: str, ready: Any, stop: Any, budget: int, prompt: int, output: int
) -> None:
    """Runs in a spawned process: prefill then decode batches, over and over, until ``stop``
    is set (each round prefills its prompts in chunks, as a worker does between decodes)."""
    from workers.engine.sampling_params import SamplingParams

    batch = BACKGROUND_BATCH
    pages = batch * (prompt + output) // 16 + batch
    engine = _engine(Path(model_dir), batch, budget, max(256, pages))
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    try:
        round_ = 0
        while not stop.is_set():
            for i in range(batch):
                engine.add_request(f"bg{round_}-{i}", [11] * prompt, params)
            while engine.has_unfinished() and not stop.is_set():
                engine.step()
                ready.set()  # stepping: the measurement may start
            round_ += 1
    finally:
        engine.close()


class BackgroundEngines:
    """``count`` engine processes stepping without pause while the calibration measures."""

    def __init__(
        self,
        model_dir: Path,
        count: int,
        budget: int,
        prompt: int = BACKGROUND_PROMPT,
        output: int = BACKGROUND_OUTPUT,
    ) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a process running torch
        self._stop = context.Event()
        self._processes = []
        readies = []
        for _ in range(count):
            ready = context.Event()
            process = context.Process(
                target=_background_engine,
                args=(str(model_dir), ready, self._stop, budget, prompt, output),
                daemon=True,
            )
            process.start()
            self._processes.append(process)
            readies.append(ready)
        try:
            for ready, process in zip(readies, self._processes, strict=True):
                if not ready.wait(BACKGROUND_START_S):
                    raise TimeoutError(
                        f"background engine (pid {process.pid}) did not step in "
                        f"{BACKGROUND_START_S:.0f} s"
                    )
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self._stop.set()
        for process in self._processes:
            process.join(30)
            if process.is_alive():  # stuck in a step: it holds nothing we need back
                process.kill()
                process.join(5)


def check_options(
    concurrent: int,
    prefill_context: int | None,
    budget: int,
    background: tuple[int, int] = (BACKGROUND_PROMPT, BACKGROUND_OUTPUT),
    repeats: int = 1,
    *,
    decode_batches: Sequence[int] = (1,),
    decode_contexts: Sequence[int] = (PROMPT_LEN,),
    mixed_batches: Sequence[int] = (),
    preset: str = "small",
) -> int:
    """Validate `run_calibration`'s process count, background requests (prompt, output tokens),
    long prompt, timed runs per point, the decode and mixed points' batches and contexts and
    the preset before anything is measured; returns the long prompt's length (default: 4
    chunks)."""
    if not decode_batches or min(decode_batches) < 1:
        raise ValueError(f"decode batches must be >= 1 sequences, got {list(decode_batches)}")
    if not decode_contexts or min(decode_contexts) < 1:
        raise ValueError(f"decode contexts must be >= 1 tokens, got {list(decode_contexts)}")
    # A mixed step's chunk gets the budget its decodes leave, cut to a page boundary: below
    # one page the prompt never advances (`chunk_tokens` gives 0) and the point never ends.
    most = budget - PAGE_SIZE
    if mixed_batches and not 1 <= min(mixed_batches) <= max(mixed_batches) <= most:
        raise ValueError(
            f"mixed batches must be 1..{most} sequences (the {budget}-token budget less one "
            f"{PAGE_SIZE}-token page for the chunk), got {list(mixed_batches)}"
        )
    if concurrent < 1:
        raise ValueError(f"concurrent must be >= 1 (engine processes), got {concurrent}")
    if repeats < 1:
        # Each point is the median of its timed runs: none leaves nothing to take it of.
        raise ValueError(f"repeats must be >= 1 (timed runs per point), got {repeats}")
    from workers.engine.presets import PRESETS

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    max_positions = PRESETS[preset]["max_position_embeddings"]  # the calibrated model's
    prompt, output = background
    if prompt < 1 or output < 1 or prompt + output > max_positions:
        raise ValueError(
            f"background requests need >= 1 prompt and >= 1 output token and at most "
            f"{max_positions} in all (the {preset} preset's positions), got {prompt} + {output}"
        )
    if prefill_context is None:
        return 4 * budget
    if prefill_context < 2 * budget or prefill_context % budget:
        # Each chunk of the long prompt is one (budget, context) point: whole chunks only.
        raise ValueError(
            f"prefill_context must be a multiple of the budget ({budget}) and at least two "
            f"chunks, got {prefill_context}"
        )
    return prefill_context


def run_calibration(
    out: str | Path,
    *,
    prefill_sizes: Sequence[int] = (32, 64, 128, 256),
    decode_batches: Sequence[int] = (1, 8, 32),
    decode_contexts: Sequence[int] = (PROMPT_LEN,),
    repeats: int = 2,
    concurrent: int = 1,
    mixed_batches: Sequence[int] = (),
    mixed_context: int = 768,
    prefill_context: int | None = None,
    background: tuple[int, int] = (BACKGROUND_PROMPT, BACKGROUND_OUTPUT),
    budget: int = BUDGET,
    preset: str = "small",
    fabric: bool = False,
    fabric_sizes: Sequence[int] = (64 << 10, 1 << 20, 4 << 20, 16 << 20),
) -> dict[str, Any]:
    from workers.engine.presets import write_random_checkpoint

    prefill_context = check_options(
        concurrent,
        prefill_context,
        budget,
        background,
        repeats,
        decode_batches=decode_batches,
        decode_contexts=decode_contexts,
        mixed_batches=mixed_batches,
        preset=preset,
    )
    # The measuring stages, one bar step each: (prefill, decode) alone and among background
    # engines (or just once), their start, the mixed points, the fabric.
    stages = (5 if concurrent > 1 else 2) + int(bool(mixed_batches)) + int(fabric)
    with (
        tempfile.TemporaryDirectory(prefix="pdserve-calibrate-") as tmp,
        progress(desc="calibrate", total=stages, unit="stage", leave=True) as bar,
    ):
        model_dir = write_random_checkpoint(preset, Path(tmp) / preset)
        # Decode points at long contexts need every sequence's pages at once (16 per page).
        pages = max(
            (b * (c + _decode_max_tokens(b, c, budget)) // 16 + b)
            for b in decode_batches
            for c in decode_contexts
        )
        pages = max(pages, -(-prefill_context // PAGE_SIZE))  # the long prefill prompt's pages
        # A mixed point runs its decoders (KV reserved for prompt and output at admission)
        # and one more prompt at once.
        mixed_pages = (
            b * -(-(mixed_context + MIXED_MAX_TOKENS) // PAGE_SIZE) + -(-mixed_context // PAGE_SIZE)
            for b in mixed_batches
        )
        pages = max((pages, *mixed_pages))
        seqs = max((*decode_batches, *(b + 1 for b in mixed_batches)))
        engine = _engine(model_dir, seqs, budget, max(256, pages))
        engines = None
        try:
            config = engine.model_config
            element = engine.kv_cache.element_size()
            data: dict[str, Any] = {
                "model": preset,
                "num_layers": config.num_layers,
                # K and V per head, or MLA's one latent per token (`ModelConfig.kv_page_bytes`).
                "kv_bytes_per_token": config.kv_page_bytes(1, element),
                "kv_capacity_tokens": engine.num_pages * engine.config.page_size,
            }

            def steps(among: str) -> dict[str, Any]:
                bar.set_postfix_str(f"prefill points{among}")
                prefill = _prefill_points(engine, prefill_sizes, repeats, prefill_context)
                bar.update()
                bar.set_postfix_str(f"decode points{among}")
                decode = [
                    point
                    for context in decode_contexts
                    for point in _decode_points(engine, decode_batches, repeats, context)
                ]
                bar.update()
                return {"prefill": prefill, "decode": decode}

            if concurrent > 1:
                logger.info("measuring the engine alone")
                data["alone"] = steps(", alone")  # before the background engines start
                logger.info("starting %d background engine(s)", concurrent - 1)
                bar.set_postfix_str("starting background engines")
                engines = BackgroundEngines(model_dir, concurrent - 1, budget, *background)
                bar.update()
                logger.info("measuring the engine among them")
                data["contention"] = {
                    "processes": concurrent,
                    "background": f"{BACKGROUND_BATCH} requests x {background[0]} prompt + "
                    f"{background[1]} output tokens",
                }
            else:
                logger.info("measuring the engine")
            data.update(steps(", among them" if concurrent > 1 else ""))
            if mixed_batches:
                logger.info("measuring mixed steps (chunks with decodes)")
                bar.set_postfix_str("mixed points")
                data["mixed"] = _mixed_points(engine, mixed_batches, mixed_context, repeats)
                bar.update()
        finally:
            if engines is not None:
                engines.close()
            engine.close()
        if fabric:
            logger.info("measuring loopback fabric writes")
            bar.set_postfix_str("fabric points")
            data["transfer"] = _fabric_points(fabric_sizes, repeats)
            bar.update()
    Path(out).write_text(json.dumps(data, indent=2) + "\n")
    return data
