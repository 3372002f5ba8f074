"""Soak: a long run of mixed requests with random cancels and worker kills.

    .venv/bin/python bench/soak.py [--config configs/local-1p3d.yaml] [--model DIR]
        [--duration 600] [--rate 2] [--kills 4] [--seed 0] [--json OUT]

Starts the configured cluster in this process (embedded Ray; the `tiny` preset when no model is
given), then sends open-loop Poisson traffic over gRPC for ``--duration`` seconds:

- greedy requests over a fixed prompt set, whose streamed tokens must be a prefix of (completed:
  equal to) the colocated engine's output on the same checkpoint, including the tokens a request
  streamed before a kill ended it;
- sampled requests (temperature, seed), checked only for ending;
- requests the client cancels: before the first token (in routing, the prefill queue or the KV
  transfer) or after a few tokens (in decode).

``--kills`` workers (prefill and decode in turn) are killed at even intervals with
``ray.kill``; the control plane replaces them. At the end, once idle, it checks what pdserve
promises: every sent request is accounted for on the client side (sent = completed + errored +
cancelled), no request hung (hit its client deadline) or failed with INTERNAL, no greedy output
differs from the reference, every worker is healthy with its page pool full and no transfer in
flight, and the router holds no request. Exit status 0 only when all hold. The report also
sorts the errored requests by the kill before them and by whether they had streamed tokens
(``errored_after_kill``). The short variant runs in ``make test``
(tests/system/test_soak.py); ``make soak`` runs the long one.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

T = TypeVar("T")

# Status codes a request may end with while workers die and are replaced; anything else (above
# all INTERNAL, or DEADLINE_EXCEEDED: the request hung) breaks the promise.
EXPECTED_ERRORS = frozenset({"UNAVAILABLE", "ABORTED", "RESOURCE_EXHAUSTED"})


@dataclass(frozen=True)
class SoakOptions:
    duration_s: float = 600.0
    rate: float = 2.0  # mean arrivals per second (Poisson)
    kills: int = 4
    seed: int = 0
    greedy_fraction: float = 0.5
    cancel_fraction: float = 0.25
    max_tokens: int = 48  # greedy requests draw 1..max_tokens; the reference has max_tokens
    request_timeout_s: float = 180.0  # a bound only: a request that reaches it "hung"
    idle_timeout_s: float = 300.0  # for the cluster to be whole and idle again at the end


@dataclass
class SoakReport:
    sent: int = 0
    completed: int = 0
    cancelled: int = 0
    errored: dict[str, int] = field(default_factory=dict)
    # The errored requests by the last worker killed before each error ("none": before any
    # kill) and by whether tokens had been streamed: {victim: {"before_first_token": n,
    # "after_tokens": m}}. A kill's errors are mostly those after it.
    errored_after_kill: dict[str, dict[str, int]] = field(default_factory=dict)
    greedy_checked: int = 0
    greedy_mismatches: list[str] = field(default_factory=list)
    kills: list[str] = field(default_factory=list)
    idle_state: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems


def greedy_references(
    model_dir: Path, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """The colocated engine's greedy tokens (EOS ignored, as the soak's requests)."""
    import torch

    from workers.engine import LLM, SamplingParams

    torch.set_num_threads(1)  # as the workers run
    llm = LLM(model_dir, num_pages=256, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [result.token_ids for result in llm.generate(prompts, params)]


def soak_prompts(vocab_size: int, seed: int, count: int = 12) -> list[list[int]]:
    """Prompts of 1 to 150 tokens (one page, page boundaries, several pages)."""
    rng = random.Random(seed)
    lengths = [1, 2, 15, 16, 17, 33, 64, 100, 150] + [rng.randint(3, 150) for _ in range(count)]
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths[:count]]


class Soak:
    """The client side. ``kill(worker_id)`` kills a worker process; ``worker_ids()`` lists the
    ids the kills choose from (prefill ones first, then decode ones, alternating)."""

    def __init__(
        self,
        address: str,
        options: SoakOptions,
        prompts: list[list[int]],
        references: list[list[int]],
        kill: Callable[[str], None],
        worker_ids: Callable[[], list[str]],
    ) -> None:
        from orchestrator.api.client import pb, pb_grpc

        self.pb, self.pb_grpc = pb, pb_grpc
        self.address = address
        self.options = options
        self.prompts = prompts
        self.references = references
        self.kill = kill
        self.worker_ids = worker_ids
        self.report = SoakReport()
        self._rng = random.Random(options.seed)
        self._errors: collections.Counter[str] = collections.Counter()
        self._last_kill = "none"

    async def run(self) -> SoakReport:
        started = time.monotonic()
        from orchestrator.api.client import channel as router_channel

        async with router_channel(self.address) as channel:
            stub = self.pb_grpc.GenerationStub(channel)
            tasks = [asyncio.create_task(self._arrivals(stub)), asyncio.create_task(self._kills())]
            await asyncio.gather(*tasks)
            await self._check_idle(stub)
        self.report.errored = dict(self._errors)
        self.report.wall_s = time.monotonic() - started
        self._judge()
        return self.report

    async def _arrivals(self, stub: Any) -> None:
        options = self.options
        end = time.monotonic() + options.duration_s
        requests: list[asyncio.Task[None]] = []
        last_progress = time.monotonic()
        while time.monotonic() < end:
            await asyncio.sleep(self._rng.expovariate(options.rate))
            requests.append(asyncio.create_task(self._one(stub, self.report.sent)))
            self.report.sent += 1
            if time.monotonic() - last_progress > 10:
                last_progress = time.monotonic()
                self._progress(end)
        await asyncio.gather(*requests)
        self._progress(end)

    def _progress(self, end: float) -> None:
        report = self.report
        left = max(0.0, end - time.monotonic())
        print(
            f"soak: sent {report.sent}, completed {report.completed}, cancelled "
            f"{report.cancelled}, errored {sum(self._errors.values())}, kills "
            f"{len(report.kills)}, {left:.0f} s of arrivals left",
            file=sys.stderr,
            flush=True,
        )

    async def _one(self, stub: Any, index: int) -> None:
        pb, options, rng = self.pb, self.options, self._rng
        greedy = rng.random() < options.greedy_fraction
        cancel_after = rng.choice([0, 0, 1, 3]) if rng.random() < options.cancel_fraction else None
        prompt_index = rng.randrange(len(self.prompts))
        max_tokens = rng.randint(1, options.max_tokens)
        sampling = pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        if greedy:
            sampling.temperature = 0.0
        else:
            sampling.temperature = 0.8
            sampling.seed = rng.randrange(2**32)
        request = pb.GenerateRequest(
            request_id=f"soak-{index}",
            prompt_token_ids=self.prompts[prompt_index],
            return_token_ids=True,
            sampling=sampling,
        )
        call = stub.Generate(request, timeout=options.request_timeout_s)
        tokens: list[int] = []
        finish = ""
        try:
            if cancel_after == 0:
                # Before the first token: routing, prefill queue or KV transfer.
                await asyncio.sleep(rng.uniform(0.0, 0.3))
                call.cancel()
            async for response in call:
                tokens.extend(response.token_ids)
                finish = response.finish_reason or finish
                if cancel_after is not None and len(tokens) >= cancel_after and not finish:
                    call.cancel()
                    break
        except asyncio.CancelledError:
            pass  # grpc.aio raises it from a cancelled call's iteration
        except grpc.aio.AioRpcError as error:
            if error.code() is grpc.StatusCode.CANCELLED and cancel_after is not None:
                pass
            else:
                self._errors[error.code().name] += 1
                when = "after_tokens" if tokens else "before_first_token"
                counts = self.report.errored_after_kill.setdefault(self._last_kill, {})
                counts[when] = counts.get(when, 0) + 1
                self._check_greedy(request, greedy, prompt_index, tokens, complete=False)
                return
        if finish:
            self.report.completed += 1
            self._check_greedy(request, greedy, prompt_index, tokens, complete=True)
            if finish != "length":
                self.report.problems.append(f"{request.request_id}: finish_reason {finish!r}")
        else:
            self.report.cancelled += 1
            self._check_greedy(request, greedy, prompt_index, tokens, complete=False)

    def _check_greedy(
        self, request: Any, greedy: bool, prompt_index: int, tokens: list[int], complete: bool
    ) -> None:
        if not greedy:
            return
        want = self.references[prompt_index][: request.sampling.max_tokens]
        self.report.greedy_checked += 1
        if (tokens != want) if complete else (tokens != want[: len(tokens)]):
            self.report.greedy_mismatches.append(
                f"{request.request_id} (prompt {prompt_index}): got {tokens[:8]}..., "
                f"want {want[:8]}..."
            )

    async def _kills(self) -> None:
        options = self.options
        if options.kills == 0:
            return
        interval = options.duration_s / (options.kills + 1)
        for i in range(options.kills):
            await asyncio.sleep(interval)
            ids = self.worker_ids()
            roles = ("prefill", "decode", "mixed")
            by_role = [[w for w in ids if w.startswith(role)] for role in roles]
            candidates = [group for group in by_role if group]
            victim = self._rng.choice(candidates[i % len(candidates)])
            print(f"soak: killing {victim}", file=sys.stderr, flush=True)
            await asyncio.to_thread(self.kill, victim)
            self.report.kills.append(victim)
            self._last_kill = f"{victim} (kill {i + 1})"

    async def _check_idle(self, stub: Any) -> None:
        """Wait (bounded) until every worker is healthy, its pool full, no transfer in flight
        and the router holds nothing; record the last state seen."""
        pb = self.pb
        deadline = time.monotonic() + self.options.idle_timeout_s
        while True:
            state = await stub.GetClusterState(pb.GetClusterStateRequest(), timeout=30)
            workers = [w for g in state.groups for w in g.workers]
            self.report.idle_state = [
                {
                    "worker": w.worker_id,
                    "health": pb.WorkerHealth.Name(w.health),
                    "free_pages": w.num_free_kv_pages,
                    "total_pages": w.num_total_kv_pages,
                    "transfers_in_flight": w.num_transfers_in_flight,
                }
                for w in workers
            ]
            whole = (
                all(w.health == pb.WORKER_HEALTH_HEALTHY for w in workers)
                and all(w.num_free_kv_pages == w.num_total_kv_pages for w in workers)
                and all(w.num_transfers_in_flight == 0 for w in workers)
                and state.num_outstanding_requests == 0
            )
            if whole:
                return
            if time.monotonic() > deadline:
                self.report.problems.append(
                    f"not idle {self.options.idle_timeout_s:.0f} s after the run: "
                    f"outstanding {state.num_outstanding_requests}, {self.report.idle_state}"
                )
                return
            await asyncio.sleep(0.5)

    def _judge(self) -> None:
        report = self.report
        accounted = report.completed + report.cancelled + sum(report.errored.values())
        if accounted != report.sent:
            report.problems.append(f"sent {report.sent} but accounted for {accounted}")
        unexpected = {c: n for c, n in report.errored.items() if c not in EXPECTED_ERRORS}
        if unexpected:
            report.problems.append(f"unexpected error codes {unexpected}")
        if report.greedy_mismatches:
            report.problems.append(f"{len(report.greedy_mismatches)} greedy outputs differ")
        if report.completed == 0:
            report.problems.append("no request completed")


class InProcessCluster:
    """`orchestrator.control.app.ServingApp` on an event loop of a background thread."""

    def __init__(self, config: Any) -> None:
        from orchestrator.control.app import ServingApp

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.app = ServingApp(config)
        self.address = self.run(self.app.start(), timeout=600)

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        try:
            self.run(self.app.stop(), timeout=300)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


def run_soak(app: Any, model_dir: Path, options: SoakOptions) -> SoakReport:
    """Run the soak against the started `orchestrator.control.app.ServingApp` ``app``; kills go
    through its controller (``ray.kill`` of the worker's actor, no restart by Ray: the
    controller replaces it)."""
    import ray

    from workers.engine.model_config import ModelConfig

    def kill(worker_id: str) -> None:
        ray.kill(app.controller.handle_of(worker_id), no_restart=True)

    def worker_ids() -> list[str]:
        return sorted(app.controller.registry.workers)

    vocab = ModelConfig.from_dir(model_dir).vocab_size
    prompts = soak_prompts(vocab, options.seed)
    references = greedy_references(model_dir, prompts, options.max_tokens)
    soak = Soak(app.address, options, prompts, references, kill, worker_ids)
    return asyncio.run(soak.run())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/local-1p3d.yaml")
    parser.add_argument("--model", default=None, help="checkpoint (default: the tiny preset)")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of arrivals")
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second")
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args()

    from orchestrator.config.cluster import ClusterConfig
    from orchestrator.control.embedded_ray import ray_environment
    from workers.log import configure_logging

    configure_logging(default="WARNING")
    ray_environment()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from workers.engine.presets import write_random_checkpoint

            model_dir = write_random_checkpoint("tiny", Path(tmp) / "tiny")
        else:
            model_dir = Path(args.model)
        config = ClusterConfig.from_yaml(args.config).with_overrides(
            model=model_dir, address="127.0.0.1:0", http_address="127.0.0.1:0"
        )
        options = SoakOptions(
            duration_s=args.duration, rate=args.rate, kills=args.kills, seed=args.seed
        )
        cluster = InProcessCluster(config)
        try:
            report = run_soak(cluster.app, model_dir, options)
        finally:
            cluster.close()
    summary = {**asdict(report), "ok": report.ok, "options": asdict(options), "config": args.config}
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
