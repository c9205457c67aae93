"""Where a request's steps come from, as the gateway calls its workers for them (pipeline.py drives
the request through them):

- `disaggregated`: the first token from a prefill worker (chosen by the router, or by load), which
  then writes the KV into pages it reserved on the decode worker; the rest from the decode worker.
  A prefill worker that goes away before the first token is replaced (up to MAX_PREFILL_RETRIES);
- `local`: every token from the decode worker, which prefills the prompt itself.

Where a request goes after its decode worker ended its stream is decode_moves.py's to say: it calls one of
these again, with the request's output so far.

Calls go out on calls kept open ahead of requests where there are some (kept_calls.py); a stream
cut short is cancelled, and a request's pages on its decode worker are Aborted in the background
(`abort_soon`), where `aclose` waits for them.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc
from prometheus_client import Counter

from protos import common_pb2, decode_pb2, prefill_pb2
from services.common import tracing
from services.common.converters import FINISH_REASON_NAMES
from services.common.metrics import RequestMetrics
from services.gateway.kept_calls import DECODE_CALLS, PREFILL_CALLS, KeptCalls
from services.gateway.prefill_route import Lookup
from services.gateway.request_bytes import BulkInputs, with_inputs
from services.gateway.request_errors import InvalidRequestError
from services.gateway.request_trace import RequestTrace
from services.gateway.timeline import PhaseClock
from services.gateway.worker_steps import (
    PrefillHandoffError,
    Progress,
    Step,
    decode_steps,
    next_event,
    observe_prefill,
    read_to_end,
    rpc_legs,
    went_away,
)
from services.gateway.workers import Worker, WorkerPool
from services.kvstore.host_id import host_id

PREFILL_RETRIES = Counter("baton_gateway_prefill_retries_total",
                          "Prompts sent to another prefill worker because theirs went away (UNAVAILABLE) before "
                          "their first token, or after it before their KV reached the decode worker")
# A prompt's prefill workers after the first, at most: a worker that stops or dies before the first
# token has sent nothing anyone saw, so the prompt goes to another. Not after any other failure: a
# prompt that made a worker's engine fail may make the next one's fail too.
MAX_PREFILL_RETRIES = 2


@dataclass(frozen=True)
class Deadlines:
    """Seconds each call may take before it fails with DEADLINE_EXCEEDED; `tokenizer_hedge_s`: before a
    prompt the gateway can encode itself is encoded here too (prompt_encoder.py)."""

    tokenizer_s: float = 10.0
    tokenizer_hedge_s: float = 1.0
    prefill_s: float = 120.0
    decode_s: float = 3600.0  # the whole stream
    abort_s: float = 5.0


class StepSources:
    """Calls `prefill` (None: colocated, every prompt prefilled on its decode worker) and `decode`
    workers for requests' steps. `kv_transport`: how prefill sends KV to decode (UNSPECIFIED: as
    prefill picks by where the decode worker is); `prefill_router`: a PrefixRouter (None: the least
    loaded prefill worker); `requests`: the gateway's request metrics, which prefill timings go to.

    A request's steps call their `on_dispatch(call)` once its prompt is on its way on `call`, the call
    computing its first token (again for each prefill worker it goes to)."""

    def __init__(self, prefill: WorkerPool | None, decode: WorkerPool, deadlines: Deadlines,
                 kv_transport: common_pb2.KVTransport, prefill_router, requests: RequestMetrics,
                 preopen_prefill_calls: bool) -> None:
        self.prefill = prefill
        self.decode = decode
        self.deadlines = deadlines
        self.kv_transport = kv_transport
        self.prefill_router = prefill_router
        self.requests = requests
        self.prefill_calls = KeptCalls("PrefillStream", "PrefillPreopened", PREFILL_CALLS, deadlines.prefill_s,
                                       preopen=preopen_prefill_calls)
        self.decode_calls = KeptCalls("Decode", "DecodePreopened", DECODE_CALLS, deadlines.decode_s)
        if prefill is not None:
            prefill.on_removed(self.prefill_calls.forget)
        decode.on_removed(self.decode_calls.forget)
        self._background: set[asyncio.Task] = set()
        self.host_id = host_id()  # a prefill worker's monotonic stamps are comparable when it is here too

    async def aclose(self) -> None:
        """End the calls kept open to the workers, and wait for the Aborts and stream reads still in
        flight (call before closing the channels)."""
        self.prefill_calls.close()
        self.decode_calls.close()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    def _next_prefill_worker(self, error: BaseException, gone: list[Worker]) -> Worker | None:
        """Where a prompt goes after `error` from its prefill worker, before its first token: another
        serving prefill worker, when the worker went away and it has gone elsewhere fewer than
        MAX_PREFILL_RETRIES times; else None (the error stands)."""
        if not (went_away(error) and len(gone) <= MAX_PREFILL_RETRIES):
            return None
        return self.prefill.pick_other(gone)

    async def disaggregated(self, request_id: str, prompt: Sequence[int], params: common_pb2.SamplingParams,
                            decode_worker: Worker, progress: Progress, clock: PhaseClock,
                            spans: RequestTrace, lookup: Lookup, on_dispatch: Callable[[grpc.aio.Call], None],
                            output: Sequence[int] = (), bulk: BulkInputs | None = None,
                            reserve_at_once: bool = False) -> AsyncIterator[Step]:
        """The first token from a prefill worker, which then writes the KV into pages it reserved
        on the decode worker; then the rest from the decode worker, once the pages are there.
        `output`: a moved request's so far (`moved`); `bulk`: the bytes of the inputs `params` carry;
        `reserve_at_once`: the pages are reserved only if free now (the prefill worker does not wait for them)."""
        # The worker counts as busy with what it has to compute: its cached prefix costs it little.
        route = self.prefill_router.choose(prompt, lookup) if self.prefill_router is not None else None
        chosen, num_cached = (route.worker, route.num_cached_tokens) if route is not None else (None, 0)
        host_tier = (prefill_pb2.HostTierSource(address=route.host_tier_address, num_blocks=route.host_tier_blocks)
                     if route is not None and route.host_tier_blocks else None)
        gone: list[Worker] = []  # prefill workers that went away before the first token
        while True:
            with self.prefill.hold(chosen, len(prompt) + len(output) - num_cached) as prefill_worker:
                clock.mark("route")
                prefill_call = None
                sent_ns = time.monotonic_ns()
                try:  # from here on, whatever fails stops the prefill worker's work too
                    with spans.calls():
                        prefill_call = await self.prefill_calls.start(prefill_worker, with_inputs(
                            prefill_pb2.PrefillRequest(
                                request_id=request_id, token_ids=prompt, sampling=params, host_tier=host_tier,
                                target={"decode_address": decode_worker.address, "transport": self.kv_transport,
                                        "reserve_at_once": reserve_at_once},
                                output_token_ids=output), bulk))
                    on_dispatch(prefill_call)
                    if not gone and route is not None:
                        try:
                            self.prefill_router.record(route, lookup)
                        except ValueError as e:  # a negative id in a block it hashed
                            raise InvalidRequestError(f"prompt {e}") from None
                    response = (await next_event(prefill_call, "first_token")).first_token
                    arrived_ns = time.monotonic_ns()
                    break
                except BaseException as e:
                    if prefill_call is not None:
                        prefill_call.cancel()
                    self.prefill_calls.replenish(prefill_worker, ended_on=e)
                    chosen = self._next_prefill_worker(e, [*gone, prefill_worker])
                    if chosen is None:
                        raise
                    gone.append(prefill_worker)
                    num_cached, host_tier = 0, None  # what the router knew was of the worker that went
                    PREFILL_RETRIES.inc()
                    # A prompt computed in chunks may have pages reserved on the decode worker under its id by
                    # the worker gone (early_pages.py): freed first, or the next one's Reserve of them is refused.
                    await self._abort(decode_worker, request_id)
        try:
            progress.num_cached_tokens = response.num_cached_tokens
            timings = response.timings
            first = Step([response.first_token_id], [response.logprobs] if response.HasField("logprobs") else [],
                          FINISH_REASON_NAMES.get(response.finish_reason), timings, response.prompt_logprobs,
                          rpc_legs(timings, self.host_id, sent_ns, arrived_ns))
            if first.finish_reason is not None:  # ended at prefill: whatever it reserved is aborted by `_run`
                observe_prefill(self.requests, timings, first.prefill_rpc_legs)
                yield first
                self.prefill_calls.replenish(prefill_worker)
                return
            yield first
            # The prefill worker writes the pages while the first token goes out.
            try:
                handoff = (await next_event(prefill_call, "handoff")).handoff
            except grpc.aio.AioRpcError as e:  # told apart from the decode call's: the move it makes differs
                raise PrefillHandoffError.of(e) from e
        except BaseException as e:  # cut short (an error, or the consumer went away): prefill stops too
            prefill_call.cancel()
            self.prefill_calls.replenish(prefill_worker, ended_on=e)
            raise
        clock.mark("kv_transfer")
        observe_prefill(self.requests, handoff.timings, first.prefill_rpc_legs)
        with spans.calls():
            call = await self.decode_calls.start(decode_worker, decode_pb2.DecodeRequest(
                request_id=request_id, reservation_id=handoff.reservation_id, prompt_token_ids=prompt,
                first_token_id=response.first_token_id, sampling=params,
                output_token_ids=output, draft_token_ids=response.draft_token_ids))
        # Once this request is done with the prefill worker: the next request's call is opened
        # off both this one's first token and its handoff.
        self.prefill_calls.replenish(prefill_worker)
        # A call for a next request, once this one's first tokens are out (or it ended sooner): one per request.
        is_replenished = False
        try:
            # Its status follows the handoff: read, the call ends as a success on both sides.
            await prefill_call.code()
            async for chunk in decode_steps(call, progress, self._mark_decode_chunks(clock, is_local=False)):
                yield chunk
                if not is_replenished:
                    self.decode_calls.replenish(decode_worker)
                    is_replenished = True
        except BaseException as e:
            if not is_replenished:
                self.decode_calls.replenish(decode_worker, ended_on=e)
            raise
        finally:
            self._close_soon(call, progress)

    async def local(self, request_id: str, prompt: Sequence[int], params: common_pb2.SamplingParams,
                    decode_worker: Worker, progress: Progress, clock: PhaseClock,
                    spans: RequestTrace, lookup: Lookup, on_dispatch: Callable[[grpc.aio.Call], None],
                    output: Sequence[int] = (), bulk: BulkInputs | None = None) -> AsyncIterator[Step]:
        """Every token from the decode worker, which prefills the prompt itself: no prefill
        worker, no transfer. The part it does not hold counts against its room until the first token.
        `output`: a moved request's so far (`moved`); `bulk`: the bytes of the inputs `params` carry."""
        request = with_inputs(decode_pb2.GenerateLocallyRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=params, output_token_ids=output), bulk)
        uncached = len(prompt) + len(output) - lookup.decode_cached_tokens
        decode_worker.queued_tokens += uncached
        is_counted = True
        clock.mark("route")
        with spans.calls():
            call = decode_worker.stub.GenerateLocally(request, timeout=self.deadlines.decode_s)
        try:
            on_dispatch(call)
            async for step in decode_steps(call, progress, self._mark_decode_chunks(clock, is_local=True)):
                if is_counted:
                    decode_worker.queued_tokens -= uncached
                    is_counted = False
                yield step
        finally:
            if is_counted:
                decode_worker.queued_tokens -= uncached
            self._close_soon(call, progress)

    def _mark_decode_chunks(self, clock: PhaseClock, is_local: bool) -> Callable[[decode_pb2.DecodeChunk], None]:
        """What each chunk from the decode worker marks on the ledger as it arrives. The first
        carries the worker's queue time (and a local prefill's compute); with a local prefill
        it brings the first token, so the rest of its wait is the call's (`rpc`)."""
        is_first = True

        def mark(chunk: decode_pb2.DecodeChunk) -> None:
            nonlocal is_first
            if not is_first:
                clock.mark("decode_steps")
                return
            is_first = False
            timings = chunk.timings
            if is_local:
                self.requests.queue.observe(timings.queue_seconds)
                clock.mark_split([("decode_queue", timings.queue_seconds),
                                  ("prefill_compute", timings.prefill_seconds)], rest="rpc")
            else:
                clock.mark_split([("decode_queue", timings.queue_seconds)], rest="decode_steps")
        return mark

    def _close_soon(self, call, progress: Progress) -> None:
        """Cancel a decode stream cut short. One that ended, or that a stop string ended here (the
        Abort naming the stop ends it on the decode worker, which counts it as finished, not
        cancelled), is read to its end in the background: when tracing, its client span ends
        only there (the pipeline stops at the last chunk)."""
        if progress.is_stopped_here and not progress.is_released:
            self._in_background(read_to_end(call, within_s=self.deadlines.abort_s))
        elif not progress.is_released:
            call.cancel()
        elif tracing.is_enabled():
            self._in_background(read_to_end(call))

    def _in_background(self, work) -> None:
        """Run `work` to its end even when the caller is cancelled; `aclose` waits for it."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(_forget(self._background))

    async def _abort(self, worker: Worker, request_id: str,
                     finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED) -> None:
        """Abort `request_id` on decode `worker` now; where that fails, the worker's lease frees it."""
        try:
            await worker.stub.Abort(decode_pb2.AbortRequest(request_id=request_id, finish_reason=finish_reason),
                                    timeout=self.deadlines.abort_s)
        except grpc.aio.AioRpcError:
            pass

    def abort_soon(self, worker: Worker, request_id: str, finish_reason: int) -> None:
        """Abort on decode in the background: it must run even when the caller was
        cancelled, and the consumer need not wait for it. `finish_reason`: why the request
        ended here when it finished (a stop string), UNSPECIFIED when it was cut short."""
        self._in_background(self._abort(worker, request_id, finish_reason))


def _forget(tasks: set[asyncio.Task]):
    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a failed Abort is logged by the lease expiry, not here
    return done


