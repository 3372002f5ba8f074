"""The engine: requests in, one step at a time, tokens out.

``step()`` is schedule → (tell the KV messenger what runs) → run the model → sample → check stop
conditions. Everything is synchronous; a caller drives it in a loop.

Roles (``EngineConfig.role``):

- ``mixed``: ``add_request``; prefill chunks and decodes share each step.
- ``prefill``: ``add_request``; computes the KV of every prompt token but the last and never
  samples. ``on_step_scheduled(chunks)`` is called before each forward pass with the
  ``ScheduledChunk``s (request id, token range, page ids) about to be written, and
  ``layer_progress`` advances layer by layer during the pass. A request finishes with reason
  ``prefilled``; its pages stay allocated (``pages_of``) until ``release(request_id)``.
- ``decode``: the KV messenger reserves pinned pages (``allocate_pinned``), has them filled,
  then hands the request over with ``add_prefilled_request(..., page_ids)``; its first step runs
  the last prompt token. (``add_request_awaiting_kv`` / ``kv_ready`` do the same with the engine
  tracking the request while it waits.)

Tensor parallelism (``tensor_parallel_size > 1``): this process is rank 0 and spawns the other
ranks (`parallel_runner`); ``rank_kv_caches`` lists every rank's KV pool; ``close()`` stops them.

Device (``EngineConfig.device``): the host CPU unless set; ``cuda`` puts the weights, the KV pool
and the step tensors on the GPU (`workers.engine.device`, checked before anything is loaded),
where pure-decode steps replay CUDA graphs (`workers.engine.decode_graphs`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from workers.engine.attention import create_attention_backend
from workers.engine.block_manager import BlockManager
from workers.engine.cache_events import CacheEventBatch
from workers.engine.config import DEFAULT_KV_MEMORY_BYTES, EngineConfig
from workers.engine.decode_graphs import DecodeGraphs
from workers.engine.device import resolve_device
from workers.engine.draft_model import DraftModelDrafter
from workers.engine.errors import InvalidRequestError, UnsupportedCheckpointError
from workers.engine.kv_cache import allocate_kv_cache, num_pages_for_budget
from workers.engine.layer_progress import LayerProgress
from workers.engine.loader import load_model
from workers.engine.model_config import ModelConfig
from workers.engine.model_runner import ModelRunner
from workers.engine.mtp_drafter import MTPDrafter
from workers.engine.outputs import EngineStats, RequestOutput
from workers.engine.parallel_runner import (
    ParallelModelRunner,
    TensorParallelRuntime,
    start_tensor_parallel,
)
from workers.engine.sampler import Sampler, SamplingRow
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from workers.engine.sequence import FinishReason, SequenceStatus
from workers.engine.sequence import Sequence as Seq
from workers.engine.speculator import Speculator
from workers.engine.step_trace import StepShapeCounts, shape_of
from workers.engine.stop_checker import StopChecker
from workers.engine.validation import validate_request

if TYPE_CHECKING:
    from workers.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

StepHook = Callable[[list[ScheduledChunk]], None]


def create_layer_progress(num_layers: int, device: torch.device | str) -> LayerProgress:
    """The CPU counter, or on a CUDA device the one the device publishes (imported only then:
    it allocates pinned memory and device tensors, which a CPU host has no use for)."""
    if str(device).startswith("cuda"):
        from workers.engine.layer_progress_cuda import CudaLayerProgress

        return CudaLayerProgress(num_layers, device)
    return LayerProgress(num_layers)


class EngineCore:
    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        *,
        on_step_scheduled: StepHook | None = None,
        detokenize: bool = True,
    ) -> None:
        self.config = config = config or EngineConfig()
        self.model_config = ModelConfig.from_dir(model_dir)
        self.max_model_len = config.max_model_len or self.model_config.max_len
        window = self.model_config.sliding_window
        if window is not None and self.max_model_len > window:
            raise UnsupportedCheckpointError(
                f"max_model_len {self.max_model_len} exceeds the checkpoint's sliding window "
                f"({window} tokens); this engine attends to the whole sequence, which differs "
                f"from sliding-window attention past it: set max_model_len <= {window}"
            )
        config.check_max_model_len(self.max_model_len)  # before loading weights: fail fast
        device = resolve_device(config.device)
        torch.manual_seed(config.seed)
        # Tensor parallelism: this process is rank 0 and holds its shard; followers the rest.
        self.tp: TensorParallelRuntime | None = None
        if config.tensor_parallel_size > 1:
            self.tp = start_tensor_parallel(model_dir, config, self.model_config, device)
            self.model = self.tp.model
        else:
            self.model, _ = load_model(model_dir, dtype=config.dtype, device=device)
        param = next(self.model.parameters())
        self.dtype, self.device = param.dtype, param.device
        # The MTP module's layer, when drafting with it or computing it for decoders that do,
        # is the pool's last (`workers.engine.mtp_drafter`): it then travels with the rest.
        spec = config.speculative
        if config.mtp_kv and config.role != "prefill":
            # Not in EngineConfig: workers are configured first and given their role after.
            raise ValueError(
                "mtp_kv is for the prefill role (mixed and decode engines that draft with mtp "
                "keep the MTP layer themselves)"
            )
        mtp_layers = config.mtp_layers
        if mtp_layers and not len(self.model.mtp):
            raise UnsupportedCheckpointError(
                "speculative method mtp needs a checkpoint with MTP modules "
                "(num_nextn_predict_layers and their weights)"
            )
        self.kv_layers = self.model_config.num_layers + mtp_layers
        if self.tp is not None:
            self.num_pages, self.kv_cache = self.tp.num_pages, self.tp.kv_cache
        else:
            self.num_pages = config.num_pages or num_pages_for_budget(
                self.model_config,
                config.page_size,
                self.dtype,
                config.kv_memory_bytes or DEFAULT_KV_MEMORY_BYTES,
                mtp_layers,
            )
            self.kv_cache = allocate_kv_cache(
                self.model_config,
                self.num_pages,
                config.page_size,
                self.dtype,
                self.device,
                mtp_layers,
            )
        # Every rank's KV pool, index = rank (the messenger registers them all).
        self.rank_kv_caches = self.tp.rank_kv_caches if self.tp else [self.kv_cache]
        backend = create_attention_backend(
            config.attention_backend,
            self.kv_cache,
            config.page_size,
            scale=self.model_config.attention_scale,
        )
        self.layer_progress = create_layer_progress(self.kv_layers, self.device)
        self.block_manager = BlockManager(self.num_pages, config.page_size)
        self.scheduler = Scheduler(config, self.block_manager, str(Path(model_dir).resolve()))
        self.runner = (
            ParallelModelRunner(
                self.tp, backend, config.page_size, self.layer_progress, self.device
            )
            if self.tp is not None
            else ModelRunner(
                self.model, backend, config.page_size, self.layer_progress, self.device
            )
        )
        # Not under tensor parallelism: a replayed graph would skip the step's broadcast to
        # the followers (`ParallelModelRunner.prepare`). Not for MoE models either (the expert
        # loop's shape depends on the routing: data-dependent, not capturable) nor MLA ones
        # (latent caches run on the torch backend).
        if (
            self.tp is None
            and self.device.type == "cuda"
            and config.cuda_graph_max_batch > 0
            and not self.model.rotary.is_dynamic
            and self.model_config.moe is None
            and self.model_config.mla is None
        ):
            self.runner.decode_graphs = DecodeGraphs(
                self.model,
                self.kv_cache,
                config.page_size,
                self.layer_progress,
                scale=backend.scale,
                max_batch=min(config.cuda_graph_max_batch, config.max_num_seqs),
                max_model_len=self.max_model_len,
                capture=True,
            )
        self.stats = EngineStats()
        self.mtp: MTPDrafter | None = None
        if mtp_layers:
            # Drafting, the module reads the step's final hidden states after it; the prefill
            # role runs it inside the pass (`_prefill_mtp`).
            self.runner.keep_hidden = config.role != "prefill"
            self.mtp = MTPDrafter(
                self.model,
                self.kv_cache,
                config.page_size,
                backend.scale,
                config.attention_backend,
                broadcast=self.tp.group.send_mtp if self.tp is not None else None,
            )
        # The step being run (`_prefill_mtp` reads its chunks).
        self._pass: SchedulerOutput | None = None
        if self.mtp is not None and config.role == "prefill":
            # The MTP layer is part of the pass: run from a forward hook of the final norm,
            # registered before the KV messenger's (`workers.kv.prefill_hooks`), which therefore
            # finds the layer written when it reports the pass over.
            self.model.norm.register_forward_hook(self._prefill_mtp)
        self.speculator: Speculator | None = None
        if spec is not None:
            self.speculator = Speculator(
                spec,
                self.block_manager,
                self.stats,
                self.max_model_len,
                mtp=self.mtp,
                draft_model=self._draft_model(model_dir, config),
            )
        self.sampler = Sampler(config.seed)
        self.stop_checker = StopChecker(
            model_dir, self.model_config, self.max_model_len, detokenize
        )
        self.on_step_scheduled = on_step_scheduled
        # What the last step that ran the model computed (`workers.engine.step_trace`).
        self.last_step_shape: StepShapeCounts | None = None
        # Every request the engine knows and has not yet reported finished.
        self._requests: dict[str, Seq] = {}
        # Prefill role: finished requests whose pages the KV messenger still reads.
        self._held: dict[str, Seq] = {}
        # Outputs produced outside a step (aborts, 1-token prompts on the prefill role).
        self._pending: list[RequestOutput] = []

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.stop_checker.tokenizer

    def close(self) -> None:
        """Stop the tensor-parallel followers (nothing to do on one rank). Idempotent."""
        if self.tp is not None:
            self.tp.close()

    def __enter__(self) -> EngineCore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- requests --------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
    ) -> None:
        prompt = self.validate(request_id, prompt_token_ids, params or SamplingParams())
        prefill_only = self.config.role == "prefill"
        seq = Seq(request_id, prompt, params or SamplingParams(), prefill_only=prefill_only)
        self._requests[request_id] = seq
        if prefill_only and seq.num_remaining_tokens == 0:
            # A one-token prompt has no KV to prefill: the decoder runs that token itself.
            self._finish(seq, FinishReason.PREFILLED)
            return
        self.stop_checker.start(seq)
        self.scheduler.add(seq)

    def allocate_pinned(self, num_pages: int) -> list[int]:
        """Reserve non-evictable pages for KV that will be written from elsewhere."""
        return self.block_manager.allocate_pinned(num_pages)

    def free_pinned(self, page_ids: Sequence[int]) -> None:
        """Give back pinned pages that were never handed to a request (failed transfer)."""
        self._check_unowned(page_ids)
        self.block_manager.free_pinned(page_ids)

    def num_prefill_pages(self, num_prompt_tokens: int) -> int:
        """Pages a decoder reserves for a prompt: the KV of all its tokens but the last."""
        return self.block_manager.pages_for_tokens(num_prompt_tokens - 1)

    def final_pages(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """Pages a request holds at most before it finishes: the KV of its prompt and answer
        (at most ``max_model_len`` tokens) and of the drafts a step verifies after them."""
        spec = self.config.speculative
        drafts = spec.num_speculative_tokens if spec is not None else 0
        tokens = min(num_prompt_tokens + max_tokens, self.max_model_len) + drafts
        return self.block_manager.pages_for_tokens(tokens)

    def num_pages_to_finish(self) -> int:
        """Pages the engine's requests (running, waiting or preempted) still take before they
        finish, over what they hold: a decoder keeps them free before it pins a new prompt's
        (`workers.kv.decode_messenger`)."""
        scheduler = self.scheduler
        return sum(
            max(
                0,
                self.final_pages(seq.num_prompt_tokens, seq.params.max_tokens) - len(seq.page_ids),
            )
            for seq in (*scheduler.running, *scheduler.waiting)
        )

    def acquire_cached_prefix(self, prompt: list[int], hashes: list[bytes]) -> list[int]:
        """Decode role with prefix caching: share the cached pages holding the longest cached
        prefix of a prompt's KV (full pages of all its tokens but the last), which then need no
        transfer; [] with caching off. ``hashes``: the prompt's page names so far, extended in
        place (a caller that asks again does not hash again). Give the pages back with
        `release_cached` unless they go to `add_prefilled_request`."""
        if not self.scheduler.caching:
            return []
        max_pages = (len(prompt) - 1) // self.config.page_size
        return self.scheduler.acquire_prefix(hashes, prompt, max_pages)

    @property
    def cache_salt(self) -> bytes | None:
        """The root of this pool's page names (`workers.engine.prefix_cache`): with the page
        size, what a router needs to name a prompt's pages as this engine does; None with
        caching off."""
        return self.scheduler.salt if self.scheduler.caching else None

    def drain_cache_events(self, full: bool = False) -> CacheEventBatch | None:
        """The page names the prefix cache gained and lost since the last call (the first
        call, or with ``full``: all it holds, as a reset); None with caching off."""
        if not self.scheduler.caching:
            return None
        events = self.block_manager.track_events(self.num_pages)
        if full:
            events.cleared()
        return events.drain()

    def count_cached_prefix(self, num_prompt_tokens: int, num_cached_pages: int) -> None:
        """Count a decoder's lookup (`acquire_cached_prefix`) whose request went ahead, in the
        prefix cache counters (a lookup given back and repeated later is counted once)."""
        if self.scheduler.caching:
            self.scheduler.count_query(num_prompt_tokens, num_cached_pages)

    def release_cached(self, page_ids: Sequence[int]) -> None:
        """Give back pages `acquire_cached_prefix` shared (their request failed or waits)."""
        self.block_manager.free(page_ids)

    def add_prefilled_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None,
        page_ids: Sequence[int],
        hidden_state: torch.Tensor | None = None,
        num_cached_pages: int = 0,
    ) -> None:
        """Admit a request whose KV for all prompt tokens but the last is in ``page_ids``: the
        first ``num_cached_pages`` shared from the prefix cache (`acquire_cached_prefix`), the
        rest pinned.

        The pages pass to the request (unpinned); its first step runs the last prompt token.
        Drafting with MTP, the pages' MTP layer holds every position but the last prefilled one,
        which the module runs from ``hidden_state``, the main model's final hidden state there
        (`workers.engine.mtp_drafter`); without it the request is served without drafts.
        """
        params = params or SamplingParams()
        prompt = self.validate(request_id, prompt_token_ids, params)
        self._check_pinned_pages(page_ids[num_cached_pages:], len(prompt), num_cached_pages)
        seq = Seq(request_id, prompt, params)
        self.block_manager.unpin(page_ids[num_cached_pages:])
        seq.page_ids = list(page_ids)
        seq.num_computed_tokens = len(prompt) - 1
        self.scheduler.name_computed_pages(seq)
        if self.mtp is not None and len(prompt) > 1:
            seq.mtp_computed = len(prompt) - 2
            if hidden_state is not None:
                seq.mtp_context = hidden_state.to(self.device, self.dtype).reshape(1, -1)
        self._requests[request_id] = seq
        self.stop_checker.start(seq)
        self.scheduler.add(seq)

    def add_request_awaiting_kv(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams | None
    ) -> list[int]:
        """Track a request whose prompt KV is yet to arrive; returns the pinned pages to fill.

        The request is invisible to the scheduler until ``kv_ready(request_id)``.
        """
        params = params or SamplingParams()
        prompt = self.validate(request_id, prompt_token_ids, params)
        page_ids = self.allocate_pinned(self.num_prefill_pages(len(prompt)))
        seq = Seq(request_id, prompt, params, status=SequenceStatus.WAITING_FOR_KV)
        seq.page_ids = page_ids
        seq.num_computed_tokens = len(prompt) - 1
        self._requests[request_id] = seq
        return list(page_ids)

    def kv_ready(self, request_id: str) -> None:
        seq = self._requests.get(request_id)
        if seq is None or seq.status is not SequenceStatus.WAITING_FOR_KV:
            raise InvalidRequestError(f"request {request_id} is not waiting for KV")
        self.block_manager.unpin(seq.page_ids)
        seq.kv_ready()
        self.stop_checker.start(seq)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """End a request in any state and free its pages; False when it is not known.

        Its final output (reason ``abort``) comes from the next ``step()``.
        """
        seq = self._requests.get(request_id) or self._held.get(request_id)
        if seq is None:
            return False
        if request_id in self._held:
            self.release(request_id)
            return True
        if seq.status is SequenceStatus.WAITING_FOR_KV:
            self.block_manager.free_pinned(seq.page_ids)
            seq.page_ids = []
        self._finish(seq, FinishReason.ABORT)
        return True

    def release(self, request_id: str) -> None:
        """Prefill role: the KV of a ``prefilled`` request has been sent; free its pages."""
        seq = self._held.pop(request_id, None)
        if seq is None:
            raise InvalidRequestError(f"request {request_id} holds no prefilled pages")
        self.scheduler.release_pages(seq)

    def pages_of(self, request_id: str) -> list[int]:
        seq = self._requests.get(request_id) or self._held.get(request_id)
        if seq is None:
            raise InvalidRequestError(f"unknown request {request_id}")
        return list(seq.page_ids)

    def has_unfinished(self) -> bool:
        return bool(self._requests or self._pending)

    def has_prompt_work(self) -> bool:
        """The next step would compute prompt tokens or admit a request (`StepLoop` pacing
        never delays those), or has outputs to hand out."""
        return bool(self._pending) or self.scheduler.has_prompt_work()

    # --- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.scheduler.waiting)
        scheduled = self.scheduler.schedule()
        self.stats.num_preemptions += len(scheduled.preempted)
        for seq in scheduled.hopeless:
            # Outgrew the pool (``length``): release the held-back text as any finish does.
            new_text, stopped = self.stop_checker.finish_text(seq)
            if stopped:
                seq.finish_reason = FinishReason.STOP
            outputs.append(self._final_output(seq, new_text))
        if scheduled.is_empty:
            return outputs
        if self.on_step_scheduled is not None:
            self.on_step_scheduled(scheduled.chunks)
        self._pass = scheduled
        logits = self.runner.run(scheduled)
        self.scheduler.postprocess(scheduled)
        self._account(scheduled)

        sampling = [
            seq for seq, c in zip(scheduled.seqs, scheduled.chunks, strict=True) if c.samples
        ]
        if logits is not None:
            outputs.extend(self._append_sampled(sampling, logits))
        if self.speculator is not None:
            self.speculator.after_step(scheduled, self.runner.last_hidden)
        for seq in scheduled.seqs:
            if seq.prefill_only and seq.num_remaining_tokens == 0:
                outputs.append(self._finish(seq, FinishReason.PREFILLED, emit=False))
        return outputs

    def _prefill_mtp(self, module: object, args: object, hidden: torch.Tensor) -> None:
        """Prefill role with ``mtp_kv``: the MTP module over the pass's positions below the last
        prefilled one (`workers.engine.mtp_drafter`), from the pass's final hidden states."""
        assert self.mtp is not None and self._pass is not None
        work = []
        row = 0
        for seq, chunk in zip(self._pass.seqs, self._pass.chunks, strict=True):
            first, row = row, row + chunk.num_tokens
            count = min(chunk.end, seq.num_tokens - 2) - chunk.start
            if count > 0:
                work.append((seq, chunk.start, hidden[first : first + count]))
        self.mtp.write(work, self.layer_progress)

    def _draft_model(self, model_dir: str | Path, config: EngineConfig) -> DraftModelDrafter | None:
        if config.speculative is None or config.speculative.model is None:
            return None
        return DraftModelDrafter(
            model_dir,
            config.speculative.model,
            self.model_config,
            self.num_pages,
            config.page_size,
            self.dtype,
            self.device,
            config.attention_backend,
        )

    def _append_sampled(self, seqs: list[Seq], logits: torch.Tensor) -> list[RequestOutput]:
        # One row per sequence, or 1 + k for one verifying k drafts: row i of a sequence is
        # sampled as if the drafts before it were kept (penalties see them as outputs).
        rows = []
        for s in seqs:
            emitted = s.output_token_ids
            for i in range(1 + len(s.spec_token_ids)):
                history = emitted + s.spec_token_ids[:i] if i else emitted
                rows.append(SamplingRow(s.params, s.prompt_token_ids, history, s.generator))
        sampled = self.sampler(logits, rows)
        now = time.perf_counter()
        outputs = []
        row = 0
        for seq in seqs:
            drafts, seq.spec_token_ids = seq.spec_token_ids, []
            tokens = sampled.token_ids[row : row + 1 + len(drafts)]
            logprobs = sampled.logprobs[row : row + 1 + len(drafts)] if sampled.logprobs else None
            row += 1 + len(drafts)
            if drafts:
                assert self.speculator is not None
                kept = self.speculator.verify(seq, drafts, tokens)
                self.scheduler.name_kept_drafts(seq, drafts[:kept])
                # The kept drafts, then the target's token after them.
                tokens = drafts[:kept] + tokens[kept : kept + 1]
                logprobs = logprobs[: kept + 1] if logprobs else None
            outputs.append(self._emit(seq, tokens, logprobs if seq.params.logprobs else None, now))
        return outputs

    def _emit(
        self, seq: Seq, tokens: list[int], logprobs: list[float] | None, now: float
    ) -> RequestOutput:
        """Append a step's tokens one by one, each checked for a stop; the rest are dropped."""
        new_text, reason, emitted = "", None, 0
        for i, token in enumerate(tokens):
            seq.append_token(token, logprobs[i] if logprobs is not None else None, now)
            self.stats.num_sampled_tokens += 1
            emitted += 1
            text, reason = self.stop_checker.check(seq)
            new_text += text
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self._forget(seq)
                break
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=seq.token_ids[-emitted:],
            token_times=[now] * emitted,
            logprobs=logprobs[:emitted] if logprobs is not None else None,
            new_text=new_text,
            finished=reason is not None,
            finish_reason=reason.value if reason is not None else None,
            num_prompt_tokens=seq.num_prompt_tokens,
        )

    # --- helpers ---------------------------------------------------------------------------

    @property
    def pool_tokens(self) -> int:
        """Tokens the whole KV pool holds."""
        return self.num_pages * self.config.page_size

    def validate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> list[int]:
        """The checks of `add_request` (typed errors, nothing allocated): the prompt as ints."""
        if request_id in self._requests or request_id in self._held:
            raise InvalidRequestError(f"request id {request_id!r} is already active")
        if any(output.request_id == request_id for output in self._pending):
            # Aborted, its final output not stepped out yet: no caller could tell that output
            # from the new request's.
            raise InvalidRequestError(
                f"request id {request_id!r} is still ending; its final output comes with the "
                "next step"
            )
        return validate_request(
            request_id,
            prompt_token_ids,
            params,
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            pool_tokens=self.pool_tokens,
            has_tokenizer=self.stop_checker.tokenizer is not None,
        )

    def _check_pinned_pages(
        self, page_ids: Sequence[int], num_prompt_tokens: int, num_cached_pages: int = 0
    ) -> None:
        needed = self.num_prefill_pages(num_prompt_tokens) - num_cached_pages
        if len(page_ids) < needed:
            raise InvalidRequestError(
                f"{len(page_ids) + num_cached_pages} pages given for {num_prompt_tokens - 1} "
                f"prefilled tokens ({needed + num_cached_pages} needed)"
            )
        if len(set(page_ids)) != len(page_ids):
            raise InvalidRequestError("page ids repeat")
        self._check_unowned(page_ids)

    def _check_unowned(self, page_ids: Sequence[int]) -> None:
        """Pinned pages no request holds. Only a request waiting for KV holds pinned pages (a
        running or held one's are unpinned), so only those are looked at: this runs on every
        hand-over, and a decoder may hold many running requests' pages."""
        owned = {
            p
            for seq in self._requests.values()
            if seq.status is SequenceStatus.WAITING_FOR_KV
            for p in seq.page_ids
        }
        for page_id in page_ids:
            if not 0 <= page_id < self.num_pages or not self.block_manager.is_pinned(page_id):
                raise InvalidRequestError(f"page {page_id} was not allocated with allocate_pinned")
            if page_id in owned:
                raise InvalidRequestError(f"page {page_id} is held by another request")

    def _finish(self, seq: Seq, reason: FinishReason, *, emit: bool = True) -> RequestOutput:
        keep = reason is FinishReason.PREFILLED
        self.scheduler.finish(seq, reason, keep_pages=keep)
        if keep:
            self._held[seq.request_id] = seq
        output = self._final_output(seq)
        if emit:
            self._pending.append(output)
        return output

    def _forget(self, seq: Seq) -> None:
        self._requests.pop(seq.request_id, None)
        self.stop_checker.forget(seq)

    def _final_output(self, seq: Seq, new_text: str = "") -> RequestOutput:
        self._forget(seq)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[],
            token_times=[],
            new_text=new_text,
            finished=True,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            page_ids=tuple(seq.page_ids),
        )

    def _account(self, scheduled: SchedulerOutput) -> None:
        num_tokens = scheduled.num_tokens
        self.stats.num_steps += 1
        self.stats.num_model_tokens += num_tokens
        self.stats.max_step_tokens = max(self.stats.max_step_tokens, num_tokens)
        self.stats.num_prefix_cache_queries = self.scheduler.num_prefix_cache_queries
        self.stats.num_prefix_cache_hits = self.scheduler.num_prefix_cache_hits
        self.last_step_shape = shape_of(scheduled.seqs, scheduled.chunks)
        self.stats.num_computed_prompt_tokens += sum(
            max(0, min(chunk.end, seq.num_prompt_tokens) - chunk.start)
            for seq, chunk in zip(scheduled.seqs, scheduled.chunks, strict=True)
        )

    def check_invariants(self) -> None:
        """Every page is free, pinned, or owned by exactly the requests that list it."""
        self.block_manager.check_invariants()
        owners: dict[int, int] = {}
        for seq in [*self._requests.values(), *self._held.values()]:
            for page_id in seq.page_ids:
                owners[page_id] = owners.get(page_id, 0) + 1
        free = self.block_manager.num_free_pages
        assert free + len(owners) + self._num_unowned_pinned(owners) == self.num_pages, "leak"
        for page_id, count in owners.items():
            assert self.block_manager.ref_count(page_id) == count, f"page {page_id} ref count"

    def _num_unowned_pinned(self, owners: dict[int, int]) -> int:
        return sum(
            1 for p in range(self.num_pages) if self.block_manager.is_pinned(p) and p not in owners
        )
