"""Engine benchmark: pdserve's engine against HF transformers ``generate`` on one checkpoint.

    .venv/bin/python bench/engine.py [--model DIR] [--new-tokens 32] [--repeats 3] [--threads N]
                                     [--dtype float32|bfloat16] [--batches 1,16,64]
                                     [--prompt-len 32] [--hf-static] [--device cpu|cuda]
                                     [--eager]
    .venv/bin/python bench/engine.py --attention [--threads N] [--repeats 3]
    .venv/bin/python bench/engine.py --peer vllm --model DIR [--dtype float32,bfloat16] ...

Measures, in one process with the same torch thread settings for both:
- prefill tokens/s for one 512-token prompt (time to the first token);
- decode tokens/s at batch 1, 16 and 64: prompts of 32 tokens, ``--new-tokens`` new tokens each
  (greedy, EOS ignored); decode time = time to generate all tokens minus time to the first.
``--prompt-len`` sets the decode prompts' length (long prompts time decode at long contexts).
``--hf-static`` adds a column for HF with ``cache_implementation="static"``: its default cache
grows by concatenation, copying every layer's K/V each step, which costs it more the longer the
context; a preallocated cache does not, so that column is the stricter reference there.
Under the table, a bound per decode batch: the **projection floor**, the time to multiply a
batch of rows by every projection weight once, in a step's order and layout, with nothing else
(no attention, norms, sampling or Python). Any engine that keeps these weights in this dtype
pays at least that per step, so HF's step divided by the floor is the largest ratio reachable
on this machine at that batch.
Each figure is the best of ``--repeats`` runs after a warm-up. ``--dtype`` sets the weight and
compute dtype of both engines (bfloat16 is what serving deployments run; on CPUs with AMX its GEMMs
are several times faster than float32, so per-step overhead weighs more).

``--device cuda`` runs both engines on the GPU (timings synchronise the device). There our
engine replays CUDA graphs for decode steps (``--eager``: it does not) and uses FlashInfer for
bfloat16 prefill when it is installed; HF runs eagerly.

``--peer vllm`` puts vLLM's CPU build in HF's place (its own venv: ``make bench-peers``; see
``bench/peers/``): for each ``--dtype`` (a comma list here; default ``float32,bfloat16``) our engine
and a resident vLLM engine take turns, A B A B, on every measurement, and the table ends with our
best dtype against vLLM's best. vLLM's decode time is measured as HF's is: generating every token
minus generating the first.

``--attention`` times only the torch attention backend's steps (``begin_step`` plus one
``forward`` per layer, cache store included) on the ``small`` preset's shapes (6 layers, 8 query /
4 KV heads, head_dim 64, 16-token pages), pages handed out in a scrambled order like a busy
pool's. Two tables: decode steps for several batches and context lengths, one column per decode
path (the C++ kernel, the sparse matmul and the page gather in float32; the kernel and the
gather in bfloat16); and prefill steps (prompts of 256-1800 tokens, a chunk after cached
context), the C++ prefill kernel against SDPA in both dtypes.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from workers.engine.config import EngineConfig
from workers.engine.cpu_gemm import linear
from workers.engine.device import DeviceError, resolve_device
from workers.engine.engine_core import EngineCore
from workers.engine.sampling_params import SamplingParams
from workers.log import configure_logging

PREFILL_LEN = 512
DECODE_PROMPT_LEN = 32
BATCH_SIZES = (1, 16, 64)


def best_of(repeats: int, run: Callable[[], float]) -> float:
    run()  # warm-up
    return min(run() for _ in range(repeats))


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=generator).tolist()


# --- pdserve -------------------------------------------------------------------------------


def engine_run(
    engine: EngineCore, prompts: list[list[int]], new_tokens: int
) -> tuple[float, float]:
    """(seconds to the first token of every request, seconds for the rest)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{i}", prompt, params)
    first_done: float | None = None
    started: set[str] = set()
    while engine.has_unfinished():
        for output in engine.step():
            if output.new_token_ids:
                started.add(output.request_id)
        if first_done is None and len(started) == len(prompts):
            first_done = time.perf_counter()
    end = time.perf_counter()
    assert first_done is not None
    return first_done - start, end - first_done


# --- HF transformers -----------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a timer read after it covers that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_run(
    model: Any, prompts: list[list[int]], new_tokens: int, cache: str | None = None
) -> float:
    """``cache``: HF's ``cache_implementation`` (None: its default, a DynamicCache that grows
    by concatenation; "static": preallocated to prompt + new tokens)."""
    input_ids = torch.tensor(prompts, device=model.device)
    synchronize(model.device)
    extra = {} if cache is None else {"cache_implementation": cache}
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            **extra,
        )
    synchronize(model.device)
    assert out.shape[1] == input_ids.shape[1] + new_tokens
    return time.perf_counter() - start


def hf_decode_seconds(
    model: Any, prompts: list[list[int]], new_tokens: int, repeats: int, cache: str | None = None
) -> float:
    """HF's decode time: generating every token minus generating the first (best of each)."""
    first = best_of(repeats, partial(hf_run, model, prompts, 1, cache))
    everything = best_of(repeats, partial(hf_run, model, prompts, new_tokens, cache))
    return max(everything - first, 1e-9)


# --- main ----------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the small preset)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    parser.add_argument(
        "--dtype",
        default=None,
        help="float32 or bfloat16 (with --peer: a comma list, default float32,bfloat16)",
    )
    parser.add_argument("--peer", choices=["vllm"], default=None, help="compare with vLLM")
    parser.add_argument(
        "--device", default="cpu", help="cpu, cuda, cuda:N or auto: where both engines run"
    )
    parser.add_argument(
        "--eager", action="store_true", help="on CUDA, run our decode steps without CUDA graphs"
    )
    parser.add_argument(
        "--batches", default=",".join(map(str, BATCH_SIZES)), help="decode batch sizes"
    )
    parser.add_argument(
        "--prompt-len", type=int, default=DECODE_PROMPT_LEN, help="decode prompts' length"
    )
    parser.add_argument(
        "--attention",
        action="store_true",
        help="time the torch attention backend's decode and prefill steps only",
    )
    parser.add_argument(
        "--hf-static",
        action="store_true",
        help="also time HF decode with a preallocated (static) KV cache",
    )
    args = parser.parse_args()
    batches = tuple(int(b) for b in args.batches.split(","))
    dtypes = (args.dtype or ("float32,bfloat16" if args.peer else "float32")).split(",")
    if any(d not in ("float32", "bfloat16") for d in dtypes) or (len(dtypes) > 1 and not args.peer):
        parser.error(f"--dtype: float32 or bfloat16 (a list only with --peer), got {args.dtype}")
    args.dtype = dtypes[0]
    try:
        device = str(resolve_device(args.device))  # "auto" becomes what it means here
    except DeviceError as error:
        parser.error(str(error))
    if args.threads:
        # On shared machines extra OpenMP threads spin against other processes; one thread
        # gives stable figures.
        torch.set_num_threads(args.threads)
    configure_logging(default=logging.WARNING)
    if args.attention:
        print_attention_table(args.repeats)
        return 0
    if args.peer:
        if args.model is None:
            parser.error("--peer needs --model DIR (a checkpoint vLLM can load)")
        from peers.compare_engine import PeerUnavailable, print_peer_table

        try:
            print_peer_table(
                Path(args.model), dtypes, batches, args.new_tokens, args.repeats, args.prompt_len
            )
        except PeerUnavailable as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from workers.engine.presets import write_random_checkpoint

            model_dir = write_random_checkpoint("small", Path(tmp) / "small")
            label = "preset small (random init)"
        else:
            model_dir = Path(args.model)
            label = str(model_dir)
        rows = measure(
            model_dir,
            args.new_tokens,
            args.repeats,
            args.dtype,
            batches,
            args.prompt_len,
            args.hf_static,
            device,
            args.eager,
        )

    where = f"{torch.get_num_threads()} threads"
    if device.startswith("cuda"):
        graphs = "eager" if args.eager else "CUDA graphs for decode"
        where = f"{torch.cuda.get_device_name(torch.device(device))} ({graphs}), {where}"
    print(f"\nmodel: {label}, {args.dtype}; torch {torch.__version__}, {where}")
    print(f"decode: {args.prompt_len}-token prompts, {args.new_tokens} new tokens, greedy\n")
    static_head = f" {'HF static':>10} | {'ratio':>6} |" if args.hf_static else ""
    print(f"| {'metric':<28} | {'pdserve':>10} | {'HF':>10} | {'ratio':>6} |{static_head}")
    static_rule = f"{'-' * 12}|{'-' * 8}|" if args.hf_static else ""
    print(f"|{'-' * 30}|{'-' * 12}|{'-' * 12}|{'-' * 8}|{static_rule}")
    for name, ours, theirs, static in rows:
        line = f"| {name:<28} | {ours:>10.1f} | {theirs:>10.1f} | {ours / theirs:>5.2f}x |"
        if args.hf_static:
            line += (
                f" {static:>10.1f} | {ours / static:>5.2f}x |"
                if static
                else f" {'-':>10} | {'':>6} |"
            )
        print(line)
    return 0


def measure(
    model_dir: Path,
    new_tokens: int,
    repeats: int,
    dtype: str = "float32",
    batches: tuple[int, ...] = BATCH_SIZES,
    prompt_len: int = DECODE_PROMPT_LEN,
    hf_static: bool = False,
    device: str = "cpu",
    eager: bool = False,
) -> list[tuple[str, float, float, float | None]]:
    """Rows of (metric, pdserve, HF, HF with a static cache or None), in tokens/s."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    hf.to(torch.device(device))  # type: ignore[arg-type]  # transformers types .to() oddly
    hf.eval()
    vocab = min(int(hf.config.vocab_size), 256 if hf.config.vocab_size < 1000 else 10**9)
    max_batch = max(batches)
    config = EngineConfig(
        dtype=dtype,
        device=device,
        cuda_graph_max_batch=0 if eager else max(batches),
        num_pages=max_batch * -(-(prompt_len + new_tokens) // 16) + 64,
        max_num_seqs=max_batch,
        max_num_batched_tokens=max(PREFILL_LEN, max_batch * prompt_len),
    )
    engine = EngineCore(model_dir, config, detokenize=False)
    rows: list[tuple[str, float, float, float | None]] = []
    floors = []

    prompt = random_prompts(1, PREFILL_LEN, vocab, seed=0)
    ours = best_of(repeats, lambda: engine_run(engine, prompt, 1)[0])
    theirs = best_of(repeats, lambda: hf_run(hf, prompt, 1))
    rows.append((f"prefill {PREFILL_LEN} tok/s", PREFILL_LEN / ours, PREFILL_LEN / theirs, None))
    print(f"prefill: pdserve {ours * 1000:.0f} ms, HF {theirs * 1000:.0f} ms", flush=True)

    for batch in batches:
        prompts = random_prompts(batch, prompt_len, vocab, seed=batch)
        decoded = batch * (new_tokens - 1)
        ours = best_of(repeats, partial(lambda p: engine_run(engine, p, new_tokens)[1], prompts))
        theirs = hf_decode_seconds(hf, prompts, new_tokens, repeats)
        steps = new_tokens - 1
        static = None
        static_note = ""
        if hf_static:
            static = hf_decode_seconds(hf, prompts, new_tokens, repeats, "static")
            static_note = f", HF static {static:.2f} s ({static / steps * 1000:.1f} ms/step)"
        rows.append(
            (
                f"decode batch {batch} tok/s",
                decoded / ours,
                decoded / theirs,
                decoded / static if static else None,
            )
        )
        print(
            f"decode batch {batch}: pdserve {ours:.2f} s ({ours / steps * 1000:.1f} ms/step), "
            f"HF {theirs:.2f} s ({theirs / steps * 1000:.1f} ms/step){static_note}",
            flush=True,
        )
        floor = best_of(repeats, partial(projection_floor_seconds, engine.model, batch))
        floors.append((batch, ours / steps, theirs / steps, floor))
    print(f"\n| {'decode batch':<12} | {'ours ms/step':>12} | {'HF ms/step':>10} | ", end="")
    print(f"{'projection floor ms':>19} | {'largest ratio reachable':>23} |")
    print(f"|{'-' * 14}|{'-' * 14}|{'-' * 12}|{'-' * 21}|{'-' * 25}|")
    for batch, ours_step, hf_step, floor in floors:
        print(
            f"| {batch:<12} | {ours_step * 1000:>12.1f} | {hf_step * 1000:>10.1f} | "
            f"{floor * 1000:>19.1f} | {hf_step / floor:>22.2f}x |"
        )
    return rows


def projection_floor_seconds(model: torch.nn.Module, batch: int, steps: int = 20) -> float:
    """Seconds per step of ``batch`` rows through every projection weight of ``model`` (its
    2-D parameters but the embedding table), each once per step and in the same order as a
    decode step, so the CPU caches hold what they would hold in one. Nothing else runs."""
    weights: list[torch.Tensor] = [
        p for name, p in model.named_parameters() if p.dim() == 2 and "embed" not in name
    ]
    lm_head = getattr(model, "lm_head", None)
    if isinstance(lm_head, torch.Tensor) and all(lm_head is not w for w in weights):
        weights.append(lm_head)  # tied to the embedding table: still one GEMM per step
    inputs = {
        w.shape[1]: torch.randn(batch, w.shape[1], dtype=w.dtype, device=w.device) for w in weights
    }
    with torch.inference_mode():
        synchronize(weights[0].device)
        start = time.perf_counter()
        for _ in range(steps):
            for weight in weights:
                linear(inputs[weight.shape[1]], weight)
        synchronize(weights[0].device)
        return (time.perf_counter() - start) / steps


# --- decode attention alone ---------------------------------------------------------------

# (label, batch, context lengths): uniform ~800 tokens (a disaggregated decode worker's load),
# mixed 100-1200, and the engine bench's short prompts.
ATTENTION_CASES: tuple[tuple[str, int, str], ...] = (
    ("batch 8 x 800", 8, "800"),
    ("batch 32 x 800", 32, "800"),
    ("batch 8 x 100-1200", 8, "mixed"),
    ("batch 32 x 100-1200", 32, "mixed"),
    ("batch 16 x 48", 16, "48"),
)


def attention_step_seconds(
    backend_class: Callable[[torch.Tensor, int, float], Any],
    seq_lens: list[int],
    repeats: int,
    num_layers: int = 6,
    num_heads: int = 8,
    num_kv_heads: int = 4,
    head_dim: int = 64,
    page_size: int = 16,
    dtype: torch.dtype = torch.float32,
    query_lens: list[int] | None = None,
) -> float:
    """Best-of-``repeats`` seconds of one step's attention: ``begin_step`` and one ``forward``
    per layer over sequences of ``seq_lens`` tokens, the last ``query_lens`` of each new (1
    each, a decode step, unless given)."""
    from workers.engine.attention.base import AttentionBatch

    new = query_lens or [1] * len(seq_lens)
    generator = torch.Generator().manual_seed(0)
    pages_per_seq = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_seq) + 8
    cache = torch.randn(
        num_layers, num_pages, 2, num_kv_heads, page_size, head_dim, generator=generator
    ).to(dtype)
    free = torch.randperm(num_pages, generator=generator).tolist()
    tables = [[free.pop() for _ in range(n)] for n in pages_per_seq]
    width = max(pages_per_seq)
    slots = [
        t[position // page_size] * page_size + position % page_size
        for t, n, q in zip(tables, seq_lens, new, strict=True)
        for position in range(n - q, n)
    ]
    num_tokens = len(slots)
    batch = AttentionBatch(
        query_start_loc=torch.tensor([0, *itertools.accumulate(new)]),
        seq_lens=torch.tensor(seq_lens),
        context_lens=torch.tensor([n - q for n, q in zip(seq_lens, new, strict=True)]),
        page_table=torch.tensor([t + [-1] * (width - len(t)) for t in tables]),
        slot_mapping=torch.tensor(slots),
        query_lens_list=tuple(new),
        seq_lens_list=tuple(seq_lens),
    )
    q = torch.randn(num_tokens, num_heads, head_dim, generator=generator).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    backend = backend_class(cache, page_size, head_dim**-0.5)

    def step() -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            backend.begin_step(batch)
            for layer in range(num_layers):
                backend.forward(layer, q, k, v, batch)
        return time.perf_counter() - start

    return best_of(repeats, step)


def attention_case_lens(batch: int, lengths: str) -> list[int]:
    if lengths == "mixed":
        generator = torch.Generator().manual_seed(batch)
        return torch.randint(100, 1201, (batch,), generator=generator).tolist()
    return [int(lengths)] * batch


# The decode paths of the torch backend (see its module docstring), as columns of the table.
ATTENTION_PATHS: tuple[tuple[str, torch.dtype, dict[str, bool]], ...] = (
    ("kernel f32", torch.float32, {"decode_kernel": True}),
    ("sparse f32", torch.float32, {"decode_kernel": False, "sparse_decode": True}),
    ("gather f32", torch.float32, {"decode_kernel": False, "sparse_decode": False}),
    ("kernel bf16", torch.bfloat16, {"decode_kernel": True}),
    ("gather bf16", torch.bfloat16, {"decode_kernel": False}),
)


# Prefill steps: (label, [(cached context, new tokens) per sequence]).
PREFILL_ATTENTION_CASES: tuple[tuple[str, list[tuple[int, int]]], ...] = (
    ("1 prompt x 512", [(0, 512)]),
    ("3 prompts x 256", [(0, 256)] * 3),
    ("1 prompt x 1800", [(0, 1800)]),
    ("256 after 1024 cached", [(1024, 256)]),
)

# Chunk tokens: the prefill kernel or one SDPA call per sequence.
PREFILL_ATTENTION_PATHS: tuple[tuple[str, torch.dtype, dict[str, bool]], ...] = (
    ("kernel f32", torch.float32, {"prefill_kernel": True}),
    ("sdpa f32", torch.float32, {"prefill_kernel": False}),
    ("kernel bf16", torch.bfloat16, {"prefill_kernel": True}),
    ("sdpa bf16", torch.bfloat16, {"prefill_kernel": False}),
)


def print_attention_table(repeats: int) -> None:
    from workers.engine.attention import cpu_kernel

    if cpu_kernel.paged_decode_attention() is None:
        print(f"(no kernel columns: {cpu_kernel.unavailable_reason()})")
    header = (
        f"attention step (6 layers), ms, torch {torch.__version__}, {torch.get_num_threads()} "
        f"threads, best of {repeats} steps after a warm-up; pages in a scrambled order like a "
        "busy pool's"
    )
    rows: list[tuple[str, list[int], list[int] | None]] = [
        (label, attention_case_lens(batch, lengths), None)
        for label, batch, lengths in ATTENTION_CASES
    ]
    _attention_table(f"decode {header}", ATTENTION_PATHS, rows, repeats)
    rows = [
        (label, [c + n for c, n in seqs], [n for _, n in seqs])
        for label, seqs in PREFILL_ATTENTION_CASES
    ]
    _attention_table(f"\nprefill {header}", PREFILL_ATTENTION_PATHS, rows, repeats)


def _attention_table(
    title: str,
    paths: tuple[tuple[str, torch.dtype, dict[str, bool]], ...],
    rows: list[tuple[str, list[int], list[int] | None]],
    repeats: int,
) -> None:
    from workers.engine.attention import cpu_kernel
    from workers.engine.attention.torch_backend import TorchAttentionBackend

    backend: Callable[..., Any] = TorchAttentionBackend  # options are keyword arguments

    if cpu_kernel.paged_decode_attention() is None:
        paths = tuple(p for p in paths if "kernel" not in p[0])
    print(f"{title}\n")
    print(f"| {'case':<22} |" + "".join(f" {name:>11} |" for name, _, _ in paths))
    print(f"|{'-' * 24}|" + "".join(f"{'-' * 13}|" for _ in paths))
    for label, seq_lens, query_lens in rows:
        cells = []
        for _, dtype, options in paths:
            seconds = attention_step_seconds(
                partial(backend, **options),
                seq_lens,
                repeats,
                dtype=dtype,
                query_lens=query_lens,
            )
            cells.append(f" {seconds * 1000:>11.2f} |")
        print(f"| {label:<22} |" + "".join(cells), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
