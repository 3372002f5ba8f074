"""Workers' token counters (`workers.service.metrics`) on real backends: a scrape of
``/metrics`` over HTTP shows exactly the prompt tokens each worker's engine ran through the model
and the tokens it sampled, on every worker role, and a counter never goes down."""

from __future__ import annotations

import queue
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.engine_helpers import prompts_of_lengths
from tests.ops.metrics_contract import EXPORTED_BY
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams
from workers.service.backend import MixedBackend, Sink, WorkerBackend
from workers.service.kv_backends import DecodeBackend, PrefillBackend
from workers.service.metrics import WorkerMetricsExporter
from workers.wire import TokenDelta, WorkerLoad

PROVIDER = "tcp;ofi_rxm"
DEADLINE_S = 60.0
PROMPT = "pdserve_prompt_tokens_total"
GENERATION = "pdserve_generation_tokens_total"


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@contextmanager
def _exported(backend: WorkerBackend, role: str, model_dir: Path) -> Iterator[int]:
    """The port of ``backend``'s /metrics, served as a worker actor serves it."""
    exporter = WorkerMetricsExporter(backend, role, str(model_dir))
    port = exporter.start("127.0.0.1", 0)
    try:
        yield port
    finally:
        exporter.stop()


def _scrape_tokens(port: int, role: str) -> dict[str, float]:
    """The two token counters of the /metrics at ``port``, read over HTTP."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        body: bytes = response.read()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name in (PROMPT, GENERATION):
                assert sample.labels["role"] == role and sample.labels["model"], sample
                assert sample.name not in values, f"{sample.name}: more than one series"
                values[sample.name] = sample.value
    return values


def _expect(role: str, prompt: int, generation: int) -> dict[str, float]:
    """What a scrape must read; a role that does not export a counter (`EXPORTED_BY`, which
    dashboards are checked against) must leave it at 0."""
    for name, value in ((PROMPT, prompt), (GENERATION, generation)):
        assert role in EXPORTED_BY[name] or value == 0, (role, name, value)
    return {PROMPT: float(prompt), GENERATION: float(generation)}


def _serve(
    backend: WorkerBackend,
    prompts: Sequence[list[int]],
    max_tokens: Sequence[int],
    prefill_endpoint: bytes = b"",
) -> list[int]:
    """Submit every request at once and wait for all to end; tokens streamed per request."""
    deltas: queue.SimpleQueue[tuple[int, TokenDelta]] = queue.SimpleQueue()

    def sink_of(i: int) -> Sink:
        return lambda delta: deltas.put((i, delta))  # step thread: only enqueues

    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        backend.submit(f"r{i}#0", prompt, _params(n), prefill_endpoint, sink_of(i))
    tokens = [0] * len(prompts)
    open_requests = set(range(len(prompts)))
    while open_requests:
        i, delta = deltas.get(timeout=DEADLINE_S)
        assert delta.error is None, delta.error
        tokens[i] += len(delta.token_ids)
        if delta.finished:
            assert delta.finish_reason == "length"
            open_requests.remove(i)
    return tokens


def test_mixed_worker_counts_every_prompt_token_and_every_sampled_one(
    tiny_model_dir: Path,
) -> None:
    # A budget of two pages a step: the 70-token prompt is prefilled in chunks, beside decodes.
    config = EngineConfig(num_pages=64, max_num_batched_tokens=32)
    backend = MixedBackend(tiny_model_dir, config)
    try:
        with _exported(backend, "mixed", tiny_model_dir) as port:
            assert _scrape_tokens(port, "mixed") == _expect("mixed", 0, 0)
            prompts, max_tokens = prompts_of_lengths([5, 37, 70], seed=3), [3, 8, 1]
            assert _serve(backend, prompts, max_tokens) == max_tokens
            assert _scrape_tokens(port, "mixed") == _expect("mixed", 5 + 37 + 70, 3 + 8 + 1)
            # Nothing ran since: a second scrape adds nothing.
            assert _scrape_tokens(port, "mixed") == _expect("mixed", 112, 12)
            prompts, max_tokens = prompts_of_lengths([9], seed=4), [2]
            assert _serve(backend, prompts, max_tokens) == max_tokens
            assert _scrape_tokens(port, "mixed") == _expect("mixed", 112 + 9, 12 + 2)
    finally:
        backend.close()


def test_a_mixed_worker_with_prefix_caching_counts_cached_tokens_apart(
    tiny_model_dir: Path,
) -> None:
    # Two prompts sharing 40 tokens (two full pages and a half), served one after the other.
    backend = MixedBackend(tiny_model_dir, EngineConfig(num_pages=64, enable_prefix_caching=True))
    queries, hits = "pdserve_prefix_cache_queries_total", "pdserve_prefix_cache_hits_total"
    try:
        with _exported(backend, "mixed", tiny_model_dir) as port:
            shared, first, second = prompts_of_lengths([40, 9, 23], seed=6)
            assert _serve(backend, [shared + first], [2]) == [2]
            assert _serve(backend, [shared + second], [2]) == [2]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
                body = answer.read().decode()
            values = {
                sample.name: sample.value
                for family in text_string_to_metric_families(body)
                for sample in family.samples
                if sample.name in (PROMPT, queries, hits)
            }
            # Both prompts looked up (49 + 63 tokens); the second found the two full pages.
            assert values == {PROMPT: 49 + 63 - 32, queries: 49 + 63, hits: 32}
    finally:
        backend.close()


def test_a_mixed_worker_with_speculative_decoding_counts_drafts(tiny_model_dir: Path) -> None:
    from workers.engine.speculative import SpeculativeConfig

    config = EngineConfig(num_pages=64, speculative=SpeculativeConfig(num_speculative_tokens=3))
    backend = MixedBackend(tiny_model_dir, config)
    drafts = "pdserve_spec_decode_num_draft_tokens_total"
    kept = "pdserve_spec_decode_num_accepted_tokens_total"
    try:
        with _exported(backend, "mixed", tiny_model_dir) as port:
            phrase = prompts_of_lengths([6], seed=8)[0]
            assert _serve(backend, [phrase * 8], [30]) == [30]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
                body = answer.read().decode()
            values = {
                sample.name: sample.value
                for family in text_string_to_metric_families(body)
                for sample in family.samples
                if sample.name in (drafts, kept)
            }
            stats = backend.engine.stats
            assert stats.num_draft_tokens > 0
            assert values == {drafts: stats.num_draft_tokens, kept: stats.num_accepted_tokens}
            per_pos = {
                int(sample.labels["position"]): sample.value
                for family in text_string_to_metric_families(body)
                for sample in family.samples
                if sample.name == "pdserve_spec_decode_num_accepted_tokens_per_pos_total"
            }
            assert len(per_pos) == 16  # every position's series exists from the start
            kept_by_pos = stats.num_accepted_tokens_per_pos
            assert [per_pos[i] for i in range(len(kept_by_pos))] == kept_by_pos
            assert sum(per_pos.values()) == stats.num_accepted_tokens
    finally:
        backend.close()


def test_a_prompt_recomputed_after_preemption_counts_again(tiny_model_dir: Path) -> None:
    # Four 1-page prompts growing to 3 pages each in a 4-page pool: sequences are preempted
    # (recompute) once they have sampled; each recomputes its whole prompt in one step (no
    # chunking within the default budget), and no sampled token is sampled again.
    backend = MixedBackend(tiny_model_dir, EngineConfig(num_pages=4))
    try:
        with _exported(backend, "mixed", tiny_model_dir) as port:
            prompts, max_tokens = prompts_of_lengths([16] * 4, seed=5), [20] * 4
            assert _serve(backend, prompts, max_tokens) == max_tokens
            num_preemptions = backend.engine.stats.num_preemptions  # the loop is idle now
            assert num_preemptions > 0
            expected = _expect("mixed", 16 * (4 + num_preemptions), 4 * 20)
            assert _scrape_tokens(port, "mixed") == expected
    finally:
        backend.close()


@pytest.mark.slow
def test_disaggregated_workers_split_each_prompt_and_only_the_decoder_samples(
    tiny_model_dir: Path,
) -> None:
    """The prefill worker computes every prompt token but the last, the decoder the last one
    (a one-token prompt goes straight to the decoder): without preemption their shares add up
    to the prompt tokens the router counts."""
    prefill = PrefillBackend(tiny_model_dir, EngineConfig(num_pages=64), PROVIDER, "127.0.0.1")
    decode = None
    try:
        decode = DecodeBackend(
            tiny_model_dir, EngineConfig(num_pages=64), PROVIDER, "127.0.0.1", {}
        )
        with (
            _exported(prefill, "prefill", tiny_model_dir) as prefill_port,
            _exported(decode, "decode", tiny_model_dir) as decode_port,
        ):
            lengths, max_tokens = [1, 2, 33, 70], [4, 1, 6, 3]
            prompts = prompts_of_lengths(lengths, seed=7)
            endpoint = prefill.prefill_endpoint()
            assert _serve(decode, prompts, max_tokens, endpoint) == max_tokens
            prefilled = sum(n - 1 for n in lengths)
            assert _scrape_tokens(prefill_port, "prefill") == _expect("prefill", prefilled, 0)
            expected = _expect("decode", len(lengths), sum(max_tokens))
            assert _scrape_tokens(decode_port, "decode") == expected
            assert prefilled + len(lengths) == sum(lengths)
    finally:
        if decode is not None:
            decode.close()
        prefill.close()


class _RestartingBackend:
    """A backend whose engine reports ``totals`` (prompt, sampled): a total below the previous
    one is an engine counting from 0 again."""

    def __init__(self) -> None:
        self.totals = (0, 0)

    def load(self) -> WorkerLoad:
        prompt, sampled = self.totals
        return WorkerLoad(0, 0, 8, 8, num_computed_prompt_tokens=prompt, num_sampled_tokens=sampled)


def test_a_counter_that_goes_back_adds_its_new_count_and_never_decreases() -> None:
    backend = _RestartingBackend()
    exporter = WorkerMetricsExporter(backend, "decode", "/models/tiny")
    labels = {"role": "decode", "model": "tiny"}
    exported: list[tuple[float | None, float | None]] = []
    for totals in [(10, 4), (15, 6), (3, 1), (3, 1), (0, 0), (5, 2)]:
        backend.totals = totals
        exporter.refresh()  # would raise if a counter were asked to go down
        # Each read collects (and so refreshes) again: unchanged totals add nothing.
        exported.append(
            (
                exporter.registry.get_sample_value(PROMPT, labels),
                exporter.registry.get_sample_value(GENERATION, labels),
            )
        )
    assert exported == [(10, 4), (15, 6), (18, 7), (18, 7), (18, 7), (23, 9)]
