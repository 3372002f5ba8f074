"""The router: validates a request, assigns it to a worker, streams its tokens back as text.

Request path (one asyncio task per request, the servicer's)::

    tokenize + validate (nothing allocated on bad input)
      ─▶ admit: a ready decode (or mixed) worker with room, by the routing policy; else wait in
         the queue (``router.max_queue``; beyond it: `QueueFullError`)
      ─▶ disaggregated: the ready prefill worker with the fewest prompt tokens in flight from
         this router is the request's KV source (`PrefillChoice`; charged until its first
         token); with none ready, the decoder prefills it itself (``local_prefill_fallback``)
      ─▶ one ``generate`` message on the worker's Connect stream (`WorkerLink`) ─▶ deltas
         ─▶ detokenize + stop strings ─▶ `StreamEvent`s
      ─▶ finally: unless it finished, an ``abort`` message (the worker aborts the request and
         frees its pages); the worker's slot is released, the queue is woken.

Request ids: the client's id (or a generated one) is the router's key (`Router.generate`
refuses it while in flight) and the id of every `StreamEvent`. Workers see a router-unique
*worker request id* per attempt, ``f"{client id}#{n}"`` with ``n`` from the router's counter
(`worker_request_id`): a client may reuse its id as soon as the router let it go, while the
abort of the old request is still on its way, and the worker must never confuse the two. The
link routes deltas by the worker id, aborts name it, and worker logs and KV transfer records
carry it (the client's id is its part before the last ``#``: `client_request_id`).

A broken stream (the worker died) ends the worker's requests with `WorkerFailedError` and makes
it *suspect* (`Suspects`: not chosen again until the controller replaced it or
``suspect_hold_seconds`` passed); so does a worker that refuses a request as unavailable
(closing, its step loop dead, its KV fabric unusable). A request its worker lost that way
before streaming a token (nothing reached the client) is sent to another ready worker, up to
``worker_retries`` times; one that already streamed tokens fails. Disaggregated, a request
whose KV transfer failed before its first token is sent again to another prefill source
(`PrefillChoice.retry_source`).

Errors are typed (`orchestrator.errors`); the servicer maps them to status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from orchestrator.control.registry import Registry, WorkerRecord
from orchestrator.errors import (
    CapacityError,
    DuplicateRequestError,
    InvalidRequestError,
    QueueFullError,
    UnavailableError,
    WorkerFailedError,
)
from orchestrator.router.policy import KVAwareWeights, RoutingPolicy, create_policy
from orchestrator.router.prefill_choice import PrefillCharge, PrefillChoice
from orchestrator.router.prefix_index import PromptPages
from orchestrator.router.prepare import check_request_id, prompt_ids, sampling_params
from orchestrator.router.suspicion import Suspects
from orchestrator.router.text_stream import TextStream, text_token_ids
from orchestrator.router.types import GenerationInput, RouterSettings, StreamEvent, Timings
from orchestrator.router.worker_link import DeltaQueue, LinkBroken, WorkerLink
from protos.pdserve.v1 import worker_pb2 as wpb
from workers.engine.cache_events import CacheEventBatch
from workers.engine.sampling_params import SamplingParams
from workers.engine.tokenizer import Tokenizer
from workers.metrics import Metrics
from workers.wire import sampling_to_proto, worker_request_id

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    request_id: str
    worker_id: str = ""
    link: WorkerLink | None = None
    worker_request_id: str = ""  # the current attempt's, once sent (`worker_request_id`)
    finished: bool = False
    # Its prompt, charged to its prefill source while its prefill runs (`PrefillChoice`).
    prefill: PrefillCharge = field(default_factory=PrefillCharge)
    prompt: PromptPages | None = None  # its prompt's pages (kv_aware's index)


class _LostBeforeFirstToken(Exception):
    """The request's worker was lost before it streamed a token: nothing reached the client,
    so another worker may serve it (`RouterSettings.worker_retries`)."""

    def __init__(self, error: WorkerFailedError) -> None:
        super().__init__(str(error))
        self.error = error


_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
_ERRORS_BY_CODE: dict[int, type[Exception]] = {
    grpc.StatusCode.INVALID_ARGUMENT.value[0]: InvalidRequestError,
    grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]: CapacityError,
}


def _worker_error(worker_id: str, delta: wpb.RequestDelta) -> Exception:
    """A request the worker ended with finish_reason "error", as a typed error."""
    kind = _ERRORS_BY_CODE.get(delta.error_code)
    if kind is not None:
        return kind(delta.error)
    return WorkerFailedError(f"{worker_id}: {delta.error}")


class Router:
    def __init__(
        self,
        settings: RouterSettings,
        registry: Registry,
        tokenizer: Tokenizer | None,
        metrics: Metrics | None = None,
        policy: RoutingPolicy | None = None,
        worker_token: str | None = None,
    ) -> None:
        """``worker_token``: the cluster's secret, which its workers' gRPC service asks for."""
        self.settings = settings
        self._worker_token = worker_token
        self.registry = registry
        self.tokenizer = tokenizer
        self.metrics = metrics
        weights = KVAwareWeights(
            settings.kv_cache_weight, settings.kv_load_weight, settings.capacity_per_worker
        )
        self.policy = policy or create_policy(settings.policy, settings.seed, weights)
        # kv_aware: what each worker's prefix cache holds (serving and prefill), as the workers
        # publish it and as this router sends them prompts.
        self.index = self.policy.index
        self.prefill = PrefillChoice(registry, metrics, settings.seed, self.index)
        self.suspects = Suspects()
        self._outstanding: dict[str, int] = {}
        self._requests: dict[str, _InFlight] = {}
        self._num_queued = 0
        self._room = asyncio.Condition()
        self._links: dict[str, WorkerLink] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._attempts = itertools.count(1)  # the ``n`` of `worker_request_id`
        self.draining = False
        self._drain_expired = False  # the grace period ended: queued requests give up
        registry.on_worker_down(self._worker_down)
        registry.on_cache_events(self._cache_events)

    # --- introspection ---------------------------------------------------------------------

    @property
    def num_outstanding(self) -> int:
        return len(self._requests)

    @property
    def num_queued(self) -> int:
        return self._num_queued

    def in_flight_on(self, record: WorkerRecord) -> int:
        """What this router still has on a worker: requests on a serving worker, prompt tokens
        charged to a prefill worker (until their first token); 0 when it can go."""
        if record.role == "prefill":
            return self.prefill.load.tokens(record.worker_id)
        return self._outstanding.get(record.worker_id, 0)

    # --- the request path ------------------------------------------------------------------

    async def generate(self, request: GenerationInput) -> AsyncGenerator[StreamEvent, None]:
        arrived = time.perf_counter()
        if self.draining:
            raise UnavailableError("the router is draining")
        if request.request_id:
            check_request_id(request.request_id)
        request_id = request.request_id or uuid.uuid4().hex
        prompt = prompt_ids(request, self.tokenizer, self.settings.max_request_bytes)
        params = sampling_params(
            request, request_id, prompt, self.settings, has_tokenizer=self.tokenizer is not None
        )
        if request_id in self._requests:
            raise DuplicateRequestError(f"request id {request_id!r} is already in flight")
        inflight = _InFlight(request_id)
        if self.index is not None:
            inflight.prompt = PromptPages(prompt)
        self._requests[request_id] = inflight
        worker: WorkerRecord | None = None  # the one holding the request's slot
        admitted = completed = False
        tried: set[str] = set()  # workers that lost this request before its first token
        try:
            worker = await self._admit(prompt=inflight.prompt)
            admitted = True
            queue_time = time.perf_counter() - arrived
            while True:
                inflight.worker_id = worker.worker_id
                try:
                    async for event in self._stream(
                        inflight, worker, prompt, params, request, arrived
                    ):
                        if event.timings is not None:
                            timings = replace(event.timings, queue_time=queue_time)
                            event = replace(event, timings=timings)
                            self._observe_finished(event, queue_time)
                            completed = True
                        yield event
                    break
                except _LostBeforeFirstToken as lost:
                    tried.add(worker.worker_id)
                    self._end_attempt(inflight)
                    if not self._may_reroute(tried):
                        raise lost.error from None
                    logger.warning("request %s: %s; trying another worker", request_id, lost)
                    if self.metrics is not None:
                        self.metrics.count_router_retry("worker")
                    # Cleared before the await: a cancel while it waits must not let the
                    # finally release the slot a second time.
                    lost_worker, worker = worker, None
                    await self._release(lost_worker.worker_id)
                    worker = await self._admit(exclude=tried, prompt=inflight.prompt)
        finally:
            del self._requests[request_id]
            self._gauge()  # `_admit` counted it while it was still in `_requests`
            self.prefill.release(inflight.prefill)
            if admitted and not completed and self.metrics is not None:
                self.metrics.count_request_success("abort")  # cancelled, timed out or failed
            if inflight.link is not None and not inflight.finished:
                # The worker aborts it and frees its pages (by its own id: the client's may
                # already name a new request).
                inflight.link.abort(inflight.worker_request_id)
            if worker is not None:
                await self._release(worker.worker_id)

    def _end_attempt(self, inflight: _InFlight) -> None:
        """Let go of an attempt that failed before its first token: its prefill source, and the
        worker's part of it (if it still has one: a refused start never became active)."""
        self.prefill.release(inflight.prefill)
        if inflight.link is not None and not inflight.finished:
            inflight.link.abort(inflight.worker_request_id)
        inflight.link, inflight.finished = None, False

    def _may_reroute(self, tried: set[str]) -> bool:
        if len(tried) > self.settings.worker_retries or self.draining:
            return False
        return bool(self._routable(tried))

    def _routable(self, exclude: set[str]) -> list[WorkerRecord]:
        """Ready serving workers that are not suspect, less ``exclude``."""
        return [
            w
            for w in self.registry.ready(self.settings.serving_role)
            if not self.suspects.is_suspect(w) and w.worker_id not in exclude
        ]

    async def _admit(
        self, exclude: set[str] | None = None, prompt: PromptPages | None = None
    ) -> WorkerRecord:
        """A worker with room for a request with ``prompt`` (`RoutingPolicy.pick`)."""
        settings = self.settings
        queued = False
        try:
            async with self._room:
                while True:
                    # A request queued before the drain keeps its place until the grace
                    # period ends (a worker may free room for it); a new one is refused.
                    if self.draining and (not queued or self._drain_expired):
                        raise UnavailableError("the router is draining")
                    ready = self._routable(exclude or set())
                    if not ready:
                        raise UnavailableError(f"no ready {settings.serving_role} worker")
                    if (
                        settings.is_disaggregated
                        and not settings.local_prefill_fallback
                        and not self.registry.ready("prefill")
                    ):
                        raise UnavailableError("no ready prefill worker")
                    room = [
                        w
                        for w in ready
                        if self._outstanding.get(w.worker_id, 0) < settings.capacity_per_worker
                    ]
                    if room:
                        worker = self.policy.pick(room, self._outstanding, prompt)
                        self._outstanding[worker.worker_id] = (
                            self._outstanding.get(worker.worker_id, 0) + 1
                        )
                        if self.index is not None and prompt is not None:
                            self._count_prefix_hit(worker, prompt)
                            self.index.record(worker, prompt)  # it will hold the prompt's KV
                            self._gauge_index()
                        if self.metrics is not None:
                            self.metrics.count_router_decision(worker.worker_id)
                        return worker
                    if not queued:
                        if self._num_queued >= settings.max_queue:
                            raise QueueFullError(
                                f"every {settings.serving_role} worker is full and "
                                f"{self._num_queued} requests wait (max_queue)"
                            )
                        queued = True
                        self._num_queued += 1
                        self._gauge()
                    # Woken by a release; the timeout re-reads readiness (workers may come back).
                    # Not `wait_for`: on Python 3.11 it drops a cancel that lands as the wait
                    # completes, and the request its client left would be admitted.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(1.0):
                            await self._room.wait()
        finally:
            if queued:
                self._num_queued -= 1
            self._gauge()

    async def _release(self, worker_id: str) -> None:
        self._outstanding[worker_id] = max(0, self._outstanding.get(worker_id, 0) - 1)
        async with self._room:
            self._room.notify()
        self._gauge()

    def _link(self, worker: WorkerRecord) -> WorkerLink:
        link = self._links.get(worker.worker_id)
        if link is not None and link.address == worker.address:
            return link
        if link is not None:  # replaced worker at a new address
            self._spawn(link.close())
        link = self._links[worker.worker_id] = WorkerLink(worker.address, self._worker_token)
        return link

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stream(
        self,
        inflight: _InFlight,
        worker: WorkerRecord,
        prompt: list[int],
        params: SamplingParams,
        request: GenerationInput,
        arrived: float,
    ) -> AsyncIterator[StreamEvent]:
        message = wpb.WorkerGenerateRequest(
            prompt_token_ids=prompt,
            sampling=sampling_to_proto(params),
        )
        tried: set[str] = set()  # prefill sources of this request ("": the decoder itself)
        generated: list[int] = []  # kv_aware: the answer's KV stays in the worker's cache
        if self.settings.is_disaggregated:
            inflight.prefill.tokens = len(prompt)
            inflight.prefill.prompt = inflight.prompt
            endpoint = self.prefill.source(inflight.prefill, tried, self.settings)
            if endpoint is None:
                raise UnavailableError("no ready prefill worker")
            message.prefill_endpoint = endpoint
        text = TextStream(self.tokenizer, prompt, params.stop)
        eos = frozenset() if params.ignore_eos else self.settings.eos_token_ids
        inflight.link = link = self._link(worker)
        deltas = await self._start(inflight, worker, link, message)
        num_tokens = 0
        first = last = 0.0
        while True:
            delta = await deltas.get()
            if isinstance(delta, LinkBroken):
                self._suspect(worker, link, "link broke")
                error = WorkerFailedError(f"{worker.worker_id}: {delta}")
                if num_tokens == 0:
                    raise _LostBeforeFirstToken(error)
                raise error
            now = time.perf_counter()
            if delta.token_ids:
                if num_tokens == 0:
                    first = now
                    self.prefill.release(inflight.prefill)
                elif self.metrics is not None:
                    self.metrics.inter_token_latency.observe(now - last)
                last = now
                num_tokens += len(delta.token_ids)
                if self.index is not None:
                    generated.extend(delta.token_ids)
            reason = delta.finish_reason
            for token_id in text_token_ids(delta.token_ids, reason, params, eos):
                text.push(token_id)
            if reason == "error":
                self.prefill.release(inflight.prefill)
                retry = self.prefill.retry_source(
                    inflight.prefill,
                    tried,
                    self.settings,
                    num_tokens=num_tokens,
                    error_code=delta.error_code,
                )
                if retry is not None:
                    # The decoder ended the request before its first token (its KV transfer
                    # failed: prefill dead, stalled or rejecting): nothing was streamed, so the
                    # same decoder asks another prefill worker (or prefills it itself).
                    logger.warning(
                        "request %s: prefill failed (%s); retrying with %s",
                        inflight.worker_request_id,
                        delta.error,
                        inflight.prefill.source or "the decoder's own prefill",
                    )
                    if self.metrics is not None:
                        self.metrics.count_router_retry("prefill")
                    message.prefill_endpoint = retry
                    deltas = await self._start(inflight, worker, link, message)
                    continue
                inflight.finished = True
                failure = _worker_error(worker.worker_id, delta)
                if isinstance(failure, WorkerFailedError) and delta.error_code == _UNAVAILABLE:
                    # Refused, never started (closing, step loop dead, KV fabric unusable).
                    self._suspect(worker, link, "it refused a request as unavailable")
                    if num_tokens == 0:
                        raise _LostBeforeFirstToken(failure)
                raise failure
            if text.stopped and not reason:  # a stop string the router saw first
                reason = "stop"
            final = bool(reason)
            event = StreamEvent(
                inflight.request_id,
                text.take(final=final),
                list(delta.token_ids) if request.return_token_ids else [],
                list(delta.logprobs) if request.return_logprobs else [],
                reason,
                len(prompt),
                num_tokens,
            )
            offsets = text.take_offsets()
            if request.return_logprobs:
                event = replace(event, text_offsets=offsets)
            if final:
                inflight.finished = delta.finish_reason != ""
                if self.index is not None:
                    self.index.record(worker, PromptPages(prompt + generated))
                end = time.perf_counter()
                itl = (last - first) / (num_tokens - 1) if num_tokens > 1 else 0.0
                ttft = first - arrived if num_tokens else end - arrived
                event = replace(event, timings=Timings(ttft, itl, end - arrived, 0.0))
            yield event
            if final:
                return

    async def _start(
        self,
        inflight: _InFlight,
        worker: WorkerRecord,
        link: WorkerLink,
        message: wpb.WorkerGenerateRequest,
    ) -> DeltaQueue:
        """Send one attempt of the request, under a new worker request id."""
        message.request_id = worker_request_id(inflight.request_id, next(self._attempts))
        inflight.worker_request_id = message.request_id
        try:
            return await link.start(message)
        except LinkBroken as error:  # every start comes before the first token
            self._suspect(worker, link, "link broke")
            raise _LostBeforeFirstToken(WorkerFailedError(str(error))) from None

    # --- failures and drain ------------------------------------------------------------------

    def _suspect(self, worker: WorkerRecord, link: WorkerLink, why: str) -> None:
        """The stream to ``worker`` broke (it died, or its host is unreachable) or it refused a
        request as unavailable: stop choosing it now rather than after the controller's next
        health check. Not for a link the router itself replaced or closed (`_link`,
        `_worker_down`): that one is no longer current."""
        if self._links.get(worker.worker_id) is not link:
            return
        self.suspects.mark(worker, self.settings.suspect_hold_seconds, why)

    def _cache_events(self, record: WorkerRecord, batch: CacheEventBatch) -> None:
        """A worker's prefix cache gained and lost pages (the controller's report)."""
        if self.index is not None:
            self.index.apply(record, batch)
            self._gauge_index()

    def _count_prefix_hit(self, worker: WorkerRecord, prompt: PromptPages) -> None:
        """The prompt's tokens in full pages, and of them those ``worker`` is thought to hold:
        the index's hit estimate (compare the workers' own prefix cache counters)."""
        if self.metrics is None or self.index is None or worker.cache_naming is None:
            return
        pages = len(prompt.names(worker.cache_naming))
        self.metrics.count_router_prefix_lookup(
            pages * worker.cache_naming.page_size, self.index.matched_tokens(worker, prompt)
        )

    def _gauge_index(self) -> None:
        if self.metrics is not None and self.index is not None:
            self.metrics.router_prefix_index_blocks.set(self.index.num_blocks)

    def _worker_down(self, record: WorkerRecord) -> None:
        """The controller took ``record`` out of service: end its requests with an error."""
        if self.index is not None:
            self.index.forget(record.worker_id)  # a replacement starts with an empty cache
            self._gauge_index()
        link = self._links.pop(record.worker_id, None)
        if link is None:
            return
        for inflight in self._requests.values():
            if inflight.link is link:
                reason = f"{record.worker_id} failed its health check"
                link.fail(inflight.worker_request_id, reason)
        self._spawn(link.close())

    async def drain(self, grace_seconds: float) -> None:
        """Refuse new requests; wait up to ``grace_seconds`` for the accepted ones: running
        ones finish, queued ones are served as workers free room. Those still queued then end
        with UNAVAILABLE (the caller then stops the workers, which ends the running ones)."""
        self.draining = True
        deadline = time.monotonic() + grace_seconds
        while self._requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._drain_expired = True
        async with self._room:
            self._room.notify_all()
        if self._requests:
            logger.warning("%d requests still running after drain", len(self._requests))

    async def close(self) -> None:
        for link in self._links.values():
            await link.close()
        self._links.clear()

    # --- metrics -----------------------------------------------------------------------------

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.num_requests_waiting.set(self._num_queued)
            self.metrics.num_requests_running.set(len(self._requests) - self._num_queued)

    def _observe_finished(self, event: StreamEvent, queue_time: float) -> None:
        metrics, timings = self.metrics, event.timings
        if metrics is None or timings is None:
            return
        if event.num_completion_tokens:
            metrics.time_to_first_token.observe(timings.time_to_first_token)
        metrics.e2e_request_latency.observe(timings.end_to_end_latency)
        metrics.request_queue_time.observe(queue_time)
        metrics.prompt_tokens.inc(event.num_prompt_tokens)
        metrics.generation_tokens.inc(event.num_completion_tokens)
        if event.finish_reason in ("stop", "length", "abort"):
            metrics.count_request_success(event.finish_reason)
