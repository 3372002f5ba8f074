"""``bench/engine.py --peer vllm``: our engine against vLLM's CPU build, turn about (A B A B).

For each dtype: our `EngineCore` in this process and one resident vLLM engine in its own venv
(`vllm_peer.VllmPeer`). Every figure is the best of ``repeats`` turns after one warm-up turn of
each; the turns alternate so that a change in the machine's load hits both sides alike, and vLLM's
processes are stopped (SIGSTOP) during our turns: idle, its engine still takes about a fifth of a
core, which slowed our decode steps by about a third (117 to 161 ms) when it ran beside them.
Both engines get as many OpenMP threads (ours: ``--threads``, else torch's default; vLLM's are
bound to as many CPUs, `vllm_peer.thread_binding`): left to itself vLLM keeps a core for its
front end, which on 2 vCPUs made its engine one thread against our two.
- prefill tok/s: one 512-token prompt, time to its first token (vLLM: ``generate`` with one new
  token);
- decode tok/s at each batch: ``new_tokens`` greedy tokens per prompt, EOS ignored; ours is the
  time after every request's first token, vLLM's the time of all tokens minus that of the first
  (as for HF).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import engine as bench_engine  # bench/engine.py: the same prompts and timing as the HF table
import torch

from peers.vllm_peer import PeerUnavailable, VllmPeer, vllm_engine_python
from workers.engine.config import EngineConfig
from workers.engine.engine_core import EngineCore

__all__ = ["PeerUnavailable", "print_peer_table"]

Row = tuple[str, str, float, float]  # (dtype, metric, ours tok/s, vLLM tok/s)


def alternate(
    repeats: int,
    ours: Callable[[], float],
    theirs: Callable[[], float],
    between: Callable[[], None] = lambda: None,
) -> tuple[float, float]:
    """Best seconds of each side over ``repeats`` turns, A B A B, after a warm-up of each;
    ``between`` runs after each of their turns (it pauses the peer during ours)."""
    best_ours = best_theirs = float("inf")
    for turn in range(repeats + 1):
        mine = ours()
        their = theirs()
        between()
        if turn:  # turn 0 is the warm-up
            best_ours, best_theirs = min(best_ours, mine), min(best_theirs, their)
    return best_ours, best_theirs


def measure_dtype(
    model_dir: Path,
    dtype: str,
    batches: Sequence[int],
    new_tokens: int,
    repeats: int,
    prompt_len: int,
) -> list[Row]:
    max_batch = max(batches)
    config = EngineConfig(
        dtype=dtype,
        num_pages=max_batch * -(-(prompt_len + new_tokens) // 16) + 64,
        max_num_seqs=max_batch,
        max_num_batched_tokens=max(bench_engine.PREFILL_LEN, max_batch * prompt_len),
    )
    ours_engine = EngineCore(model_dir, config, detokenize=False)
    vocab = min(ours_engine.model_config.vocab_size, 32000)
    rows: list[Row] = []
    threads = torch.get_num_threads()  # vLLM's engine gets as many (module docstring)
    with VllmPeer(model_dir, dtype, max_num_seqs=max_batch, threads=threads) as peer:
        print(f"vLLM {peer.version}, {dtype}, {threads} threads each: measuring", flush=True)
        prompt = bench_engine.random_prompts(1, bench_engine.PREFILL_LEN, vocab, seed=0)
        peer.pause()
        ours, theirs = alternate(
            repeats,
            lambda: bench_engine.engine_run(ours_engine, prompt, 1)[0],
            lambda: peer.generate_seconds(prompt, 1),
            peer.pause,
        )
        length = bench_engine.PREFILL_LEN
        rows.append((dtype, f"prefill {length} tok/s", length / ours, length / theirs))
        print(f"  prefill: pdserve {ours * 1000:.0f} ms, vLLM {theirs * 1000:.0f} ms", flush=True)
        for batch in batches:
            prompts = bench_engine.random_prompts(batch, prompt_len, vocab, seed=batch)

            def ours_decode(p: list[list[int]] = prompts) -> float:
                return bench_engine.engine_run(ours_engine, p, new_tokens)[1]

            def theirs_decode(p: list[list[int]] = prompts) -> float:
                # vLLM's first token, timed in the same turn, so both parts see the same load.
                return max(peer.generate_seconds(p, new_tokens) - peer.generate_seconds(p, 1), 1e-9)

            ours, theirs = alternate(repeats, ours_decode, theirs_decode, peer.pause)
            decoded = batch * (new_tokens - 1)
            rows.append((dtype, f"decode batch {batch} tok/s", decoded / ours, decoded / theirs))
            steps = new_tokens - 1
            print(
                f"  decode batch {batch}: pdserve {ours / steps * 1000:.1f} ms/step, "
                f"vLLM {theirs / steps * 1000:.1f} ms/step",
                flush=True,
            )
    return rows


def print_peer_table(
    model_dir: Path,
    dtypes: Sequence[str],
    batches: Sequence[int],
    new_tokens: int,
    repeats: int,
    prompt_len: int,
) -> None:
    vllm_engine_python()  # no venv, or a CPU it cannot run on: say so before loading anything
    rows: list[Row] = []
    for dtype in dtypes:
        rows += measure_dtype(model_dir, dtype, batches, new_tokens, repeats, prompt_len)
    print(
        f"\nmodel: {model_dir}; decode: {prompt_len}-token prompts, {new_tokens} new tokens; "
        f"{torch.get_num_threads()} threads each\n"
    )
    print(f"| {'dtype':<9} | {'metric':<24} | {'pdserve':>9} | {'vLLM':>9} | {'ratio':>6} |")
    print(f"|{'-' * 11}|{'-' * 26}|{'-' * 11}|{'-' * 11}|{'-' * 8}|")
    for dtype, metric, ours, theirs in rows:
        print(
            f"| {dtype:<9} | {metric:<24} | {ours:>9.1f} | {theirs:>9.1f} | {ours / theirs:>5.2f}x |"
        )
    if len(dtypes) > 1:
        print(f"\n| {'best dtype each':<24} | {'pdserve':>18} | {'vLLM':>18} | {'ratio':>6} |")
        print(f"|{'-' * 26}|{'-' * 20}|{'-' * 20}|{'-' * 8}|")
        for metric in dict.fromkeys(m for _, m, _, _ in rows):
            ours_best = max((o, d) for d, m, o, _ in rows if m == metric)
            theirs_best = max((t, d) for d, m, _, t in rows if m == metric)
            print(
                f"| {metric:<24} | {ours_best[0]:>9.1f} {ours_best[1]:>8} | "
                f"{theirs_best[0]:>9.1f} {theirs_best[1]:>8} | {ours_best[0] / theirs_best[0]:>5.2f}x |"
            )
