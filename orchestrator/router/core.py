"""The router: validates a request, assigns it to a worker, streams its tokens back as text.

Request path (one asyncio task per request, the servicer's)::

    tokenize + validate (nothing allocated on bad input)
      ─▶ admit: a ready decode (or mixed) worker with room, by the routing policy; else wait in
         the queue (``router.max_queue``; beyond it: `QueueFullError`)
      ─▶ disaggregated: the ready prefill worker with the fewest prompt tokens in flight from
         this router is the request's KV source (`PrefillLoad`; charged until its first token);
         with none ready, the decoder prefills it itself (``local_prefill_fallback``)
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
it *suspect*: not chosen again until the controller replaced it (new generation) or
``suspect_hold_seconds`` passed, so no request is sent to a dead worker while the controller's
health check has not yet noticed. A worker that refuses a request as unavailable (closing, its
step loop dead, its KV fabric unusable) becomes suspect too. A request its worker lost that way
before streaming a token (nothing reached the client) is sent to another ready worker, up to
``worker_retries`` times; one that already streamed tokens fails. Disaggregated, while no
prefill worker is ready (or every one a request tried failed it), its decoder prefills it
itself (``local_prefill_fallback``, an empty prefill endpoint).

Errors are typed (`orchestrator.errors`); the servicer maps them to status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from orchestrator.config_sections import DEFAULT_MAX_REQUEST_BYTES
from orchestrator.errors import (
    CapacityError,
    DuplicateRequestError,
    InvalidRequestError,
    QueueFullError,
    UnavailableError,
    WorkerFailedError,
)
from orchestrator.policy import PrefillLoad, RoutingPolicy, create_policy
from orchestrator.registry import Registry, WorkerRecord
from orchestrator.text_stream import TextStream
from orchestrator.worker_backend import worker_request_id
from orchestrator.worker_link import DeltaQueue, LinkBroken, WorkerLink
from orchestrator.worker_service import sampling_to_proto
from protos.pdserve.v1 import worker_pb2 as wpb
from workers.engine.sampling_params import SamplingParams
from workers.engine.tokenizer import Tokenizer
from workers.engine.validation import validate_request
from workers.metrics import Metrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterSettings:
    """What the router needs to know of the cluster (from `ClusterConfig`)."""

    serving_role: str  # "decode" or "mixed"
    is_disaggregated: bool
    vocab_size: int
    max_model_len: int
    pool_tokens: int  # KV tokens a serving worker holds when empty
    capacity_per_worker: int  # requests in flight per worker before the router queues
    max_queue: int
    default_max_tokens: int
    policy: str = "least_outstanding"
    seed: int | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # also bounds a prompt's UTF-8 bytes
    # A worker whose link broke is not chosen again until the controller replaced it (new
    # generation or address) or this long passed (a break that was not the worker's death).
    suspect_hold_seconds: float = 10.0
    # Other prefill workers a disaggregated request may try when its KV transfer failed before
    # any token was streamed (0: fail it at once).
    prefill_retries: int = 1
    # Other serving workers a request may try when its worker was lost (link broken, failed
    # health check, refused as unavailable) before any token was streamed (0: fail it at once).
    worker_retries: int = 1
    # Disaggregated: while no prefill worker is ready (or every one tried failed), the decoder
    # prefills the request itself (in its own steps, slowing its other requests' tokens)
    # rather than the request failing.
    local_prefill_fallback: bool = True
    # EOS ids whose text is not output (the engine's `StopChecker`: the model config's and the
    # tokenizer's); ``ignore_eos`` disables them.
    eos_token_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class GenerationInput:
    """A client request after the servicer read it (sampling: `SamplingParams` fields the
    client set; max_tokens None means the router's default)."""

    request_id: str = ""
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None
    # OpenAI's rule (the HTTP front): an explicit max_tokens that the prompt leaves no room for
    # is refused (`ContextLengthError`). Else (gRPC) it is served and ends with "length" at
    # max_model_len.
    max_tokens_within_context: bool = False
    return_token_ids: bool = False
    return_logprobs: bool = False


class ContextLengthError(InvalidRequestError):
    """The prompt plus an explicit max_tokens exceed max_model_len
    (`GenerationInput.max_tokens_within_context`)."""


@dataclass(frozen=True)
class Timings:
    time_to_first_token: float
    mean_inter_token_latency: float
    end_to_end_latency: float
    queue_time: float


@dataclass(frozen=True)
class StreamEvent:
    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str = ""
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    timings: Timings | None = None
    # With return_logprobs: where each of ``token_ids``' texts starts in the whole answer.
    text_offsets: list[int] = field(default_factory=list)


@dataclass
class _InFlight:
    request_id: str
    worker_id: str = ""
    link: WorkerLink | None = None
    worker_request_id: str = ""  # the current attempt's, once sent (`worker_request_id`)
    finished: bool = False
    # The prefill source charged this request's prompt in `Router.prefill_load` ("": none, or
    # released: the first token came, so its prefill is over).
    prefill_source: str = ""
    prompt_tokens: int = 0


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
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.policy = policy or create_policy(settings.policy, settings.seed)
        self.prefill_load = PrefillLoad(settings.seed)
        self._outstanding: dict[str, int] = {}
        self._requests: dict[str, _InFlight] = {}
        self._num_queued = 0
        self._room = asyncio.Condition()
        self._links: dict[str, WorkerLink] = {}
        # worker id -> (generation, address, until): its link broke (see `_suspect`).
        self._suspects: dict[str, tuple[int, str, float]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._attempts = itertools.count(1)  # the ``n`` of `worker_request_id`
        self.draining = False
        self._drain_expired = False  # the grace period ended: queued requests give up
        registry.on_worker_down(self._worker_down)

    # --- introspection ---------------------------------------------------------------------

    @property
    def num_outstanding(self) -> int:
        return len(self._requests)

    @property
    def num_queued(self) -> int:
        return self._num_queued

    # --- the request path ------------------------------------------------------------------

    async def generate(self, request: GenerationInput) -> AsyncGenerator[StreamEvent, None]:
        arrived = time.perf_counter()
        if self.draining:
            raise UnavailableError("the router is draining")
        request_id = request.request_id or uuid.uuid4().hex
        prompt = self._prompt_ids(request)
        params = self._sampling(request, request_id, prompt)
        if request_id in self._requests:
            raise DuplicateRequestError(f"request id {request_id!r} is already in flight")
        inflight = _InFlight(request_id)
        self._requests[request_id] = inflight
        worker: WorkerRecord | None = None  # the one holding the request's slot
        admitted = completed = False
        tried: set[str] = set()  # workers that lost this request before its first token
        try:
            worker = await self._admit()
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
                    worker = await self._admit(exclude=tried)
        finally:
            del self._requests[request_id]
            self._gauge()  # `_admit` counted it while it was still in `_requests`
            self._release_prefill(inflight)
            if admitted and not completed and self.metrics is not None:
                self.metrics.count_request_success("abort")  # cancelled, timed out or failed
            if inflight.link is not None and not inflight.finished:
                # The worker aborts it and frees its pages (by its own id: the client's may
                # already name a new request).
                inflight.link.abort(inflight.worker_request_id)
            if worker is not None:
                await self._release(worker.worker_id)

    def _prompt_ids(self, request: GenerationInput) -> list[int]:
        has_text, has_ids = bool(request.prompt), bool(request.prompt_token_ids)
        if has_text == has_ids:
            raise InvalidRequestError("give exactly one of prompt and prompt_token_ids")
        if has_ids:
            return list(request.prompt_token_ids or [])
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: give prompt_token_ids")
        text = request.prompt or ""
        # Checked before tokenizing: the tokenizer's time grows with the text, and a lone
        # surrogate (JSON can carry one) is no text a tokenizer can take.
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError:
            raise InvalidRequestError("the prompt is not valid Unicode text") from None
        limit = self.settings.max_request_bytes
        if size > limit:
            raise InvalidRequestError(
                f"prompt of {size} bytes exceeds the router's limit of {limit} bytes "
                "(router.max_request_bytes)"
            )
        return self.tokenizer.encode(text)

    def _sampling(
        self, request: GenerationInput, request_id: str, prompt: list[int]
    ) -> SamplingParams:
        settings = self.settings
        room = max(1, settings.max_model_len - len(prompt))
        max_tokens = request.max_tokens
        if max_tokens is None:
            max_tokens = min(settings.default_max_tokens, room)
        elif request.max_tokens_within_context and len(prompt) + max_tokens > (
            settings.max_model_len
        ):
            raise ContextLengthError(
                f"this model's maximum context length is {settings.max_model_len} tokens; "
                f"the request asks for {len(prompt) + max_tokens} ({len(prompt)} in the "
                f"prompt, max_tokens {max_tokens})"
            )
        elif max_tokens > settings.max_model_len:
            # No request can ever generate that many; a smaller excess over what the prompt
            # leaves is served and ends with "length" at max_model_len.
            raise InvalidRequestError(
                f"max_tokens {max_tokens} exceeds max_model_len={settings.max_model_len}"
            )
        params = SamplingParams(
            **request.sampling, max_tokens=max_tokens, logprobs=request.return_logprobs
        )
        validate_request(  # the engine's own checks: INVALID_ARGUMENT before any allocation
            request_id,
            prompt,
            params,
            vocab_size=settings.vocab_size,
            max_model_len=settings.max_model_len,
            pool_tokens=settings.pool_tokens,
            has_tokenizer=self.tokenizer is not None,
        )
        return params

    def _end_attempt(self, inflight: _InFlight) -> None:
        """Let go of an attempt that failed before its first token: its prefill source, and the
        worker's part of it (if it still has one: a refused start never became active)."""
        self._release_prefill(inflight)
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
            if not self._is_suspect(w) and w.worker_id not in exclude
        ]

    async def _admit(self, exclude: set[str] | None = None) -> WorkerRecord:
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
                        worker = self.policy.pick(room, self._outstanding)
                        self._outstanding[worker.worker_id] = (
                            self._outstanding.get(worker.worker_id, 0) + 1
                        )
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
        link = self._links[worker.worker_id] = WorkerLink(worker.address)
        return link

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _text_tokens(
        self, token_ids: Sequence[int], reason: str, params: SamplingParams
    ) -> Sequence[int]:
        """The delta's tokens whose text is output: as in the engine (`StopChecker`, vLLM), a
        token that stopped the request as EOS or a stop token id adds none (the id is still
        streamed). A stop string's last token is pushed: `TextStream` cuts the string off."""
        if reason != "stop" or not token_ids:
            return token_ids
        last = token_ids[-1]
        eos = () if params.ignore_eos else self.settings.eos_token_ids
        return token_ids[:-1] if last in params.stop_token_ids or last in eos else token_ids

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
        if self.settings.is_disaggregated:
            inflight.prompt_tokens = len(prompt)
            endpoint = self._prefill_source(inflight, tried)
            if endpoint is None:
                raise UnavailableError("no ready prefill worker")
            message.prefill_endpoint = endpoint
        text = TextStream(self.tokenizer, prompt, params.stop)
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
                    self._release_prefill(inflight)
                elif self.metrics is not None:
                    self.metrics.inter_token_latency.observe(now - last)
                last = now
                num_tokens += len(delta.token_ids)
            reason = delta.finish_reason
            for token_id in self._text_tokens(delta.token_ids, reason, params):
                text.push(token_id)
            if reason == "error":
                self._release_prefill(inflight)
                retry = self._retry_source(delta, num_tokens, tried, inflight)
                if retry is not None:
                    # The decoder ended the request before its first token (its KV transfer
                    # failed: prefill dead, stalled or rejecting): nothing was streamed, so the
                    # same decoder asks another prefill worker (or prefills it itself).
                    logger.warning(
                        "request %s: prefill failed (%s); retrying with %s",
                        inflight.worker_request_id,
                        delta.error,
                        inflight.prefill_source or "the decoder's own prefill",
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

    def _retry_source(
        self, delta: wpb.RequestDelta, num_tokens: int, tried: set[str], inflight: _InFlight
    ) -> bytes | None:
        """Another prefill source (`_prefill_source`) for a request whose decoder failed it
        before any token with a worker-side error (``error_code`` 0: not a refusal of the
        request itself), while ``prefill_retries`` allows; None otherwise."""
        if (
            not self.settings.is_disaggregated
            or num_tokens > 0
            or delta.error_code != 0
            or len(tried) > self.settings.prefill_retries
        ):
            return None
        return self._prefill_source(inflight, tried)

    def _prefill_source(self, inflight: _InFlight, tried: set[str]) -> bytes | None:
        """The endpoint of the least-loaded ready prefill worker not in ``tried`` (charged:
        `_pick_prefill`); else, with ``local_prefill_fallback``, b"": the decoder prefills the
        request itself, once; else None. The choice is added to ``tried``."""
        others = [w for w in self.registry.ready("prefill") if w.worker_id not in tried]
        if others:
            source = self._pick_prefill(inflight, others)
            tried.add(source.worker_id)
            return source.prefill_endpoint
        if self.settings.local_prefill_fallback and "" not in tried:
            tried.add("")
            return b""
        return None

    def _pick_prefill(self, inflight: _InFlight, workers: list[WorkerRecord]) -> WorkerRecord:
        """Charge the request's prompt to the least-loaded of ``workers`` and make it the
        request's source (`_release_prefill` undoes both)."""
        source = self.prefill_load.pick(workers, inflight.prompt_tokens)
        inflight.prefill_source = source.worker_id
        self._prefill_gauge(source.worker_id)
        return source

    def _release_prefill(self, inflight: _InFlight) -> None:
        """Its prefill is over (first token) or will not happen (error, retry, end)."""
        worker_id, inflight.prefill_source = inflight.prefill_source, ""
        if worker_id:
            self.prefill_load.release(worker_id, inflight.prompt_tokens)
            self._prefill_gauge(worker_id)

    def _prefill_gauge(self, worker_id: str) -> None:
        if self.metrics is not None:
            tokens = self.prefill_load.tokens(worker_id)
            self.metrics.set_prefill_tokens_in_flight(worker_id, tokens)

    def _suspect(self, worker: WorkerRecord, link: WorkerLink, why: str) -> None:
        """The stream to ``worker`` broke (it died, or its host is unreachable) or it refused a
        request as unavailable: stop choosing it now rather than after the controller's next
        health check. Not for a link the router itself replaced or closed (`_link`,
        `_worker_down`): that one is no longer current."""
        if self._links.get(worker.worker_id) is not link:
            return
        until = time.monotonic() + self.settings.suspect_hold_seconds
        self._suspects[worker.worker_id] = (worker.generation, worker.address, until)
        logger.warning("%s: %s; not routing to it until it is replaced", worker.worker_id, why)

    def _is_suspect(self, worker: WorkerRecord) -> bool:
        """Cleared by a replacement (the controller bumps the generation and the worker has a
        new address) or when the hold time passed."""
        mark = self._suspects.get(worker.worker_id)
        if mark is None:
            return False
        generation, address, until = mark
        if (worker.generation, worker.address) != (generation, address) or (
            time.monotonic() >= until
        ):
            del self._suspects[worker.worker_id]
            return False
        return True

    def _worker_down(self, record: WorkerRecord) -> None:
        """The controller took ``record`` out of service: end its requests with an error."""
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
