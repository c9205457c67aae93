"""The Prefill gRPC service (protos/prefill.proto) over one EngineLoop.

One call: validate, open the KV target's transport (the one the target names, or
with none named the fastest that reaches it: kv_writer.py), run the prompt as a
prefill-only request (the engine chunks it and batches it with others), then write
its held pages into the target and release them. A target with only a decode
address gets its pages reserved here, by a Reserve call made once the first token is
out (decode_reservations.py), which waits there, up to --kv-reserve-wait-s, for pages to free when
too few are; the handoff names the reservation for Decode.
PrefillStream sends the first token before reserving and writing the pages (the
gateway's first token then waits on neither) and the handoff after; Prefill answers
once, with both. A decode worker that cannot take the pages (RESOURCE_EXHAUSTED, by the end of
that wait) therefore ends a PrefillStream after its first token. The pages are released on
every path: success, a failed write, an error and client cancellation (which also
aborts a prompt still computing). PrefillPreopened is PrefillStream on a call the
gateway opened ahead of its request, which is the call's first message; it sends its
response headers as soon as it is opened, and PrefillStream while the prompt computes, so
the first token later goes out without them (services/common/grpc_server.EarlyHeaders says
what that saves).

Status codes:
- INVALID_ARGUMENT: empty request id, no tokens, sampling values out of range, a token
  outside the vocabulary, a prompt longer than the context or a request id in use (the
  last three as the engine refuses them), a target missing its layout or what its
  transport needs (shm name, address, IPC handle), or too few (or bad) target blocks.
- FAILED_PRECONDITION: the target's layout or model fingerprint is not ours, or its
  segment (IPC handle) does not exist or disagrees with its layout (checked before computing).
- The decode worker's own code when it refuses pages sent over GRPC_STREAM
  (FAILED_PRECONDITION, DATA_LOSS, NOT_FOUND, INVALID_ARGUMENT, UNAVAILABLE), or
  cannot reserve them (RESOURCE_EXHAUSTED: no free pages; INVALID_ARGUMENT), its trailing metadata
  saying so (services/common/relayed_errors.py): an UNAVAILABLE that is the decode worker's.
- UNAVAILABLE: the engine is still loading and warming up, or has failed (the worker is stopping),
  also for a prompt still queued behind the step that failed: it never ran.
- INTERNAL: the engine failed in a step that was computing the prompt.
- ABORTED: the request was aborted in the engine.
- NOT_FOUND: the reservation of the pages ended (its lease ran out, or it was aborted) before a
  SHARED_MEMORY or CUDA_IPC copy into them, which then copies nothing (services/kvstore/page_fence.py),
  as the Decode call would find it.

A long prompt whose pages go by GRPC_STREAM (computed in several chunks) may send each chunk's
pages while the next computes, reserving them after its first chunk (early_pages.py); the handoff
then writes only the last ones.

Timings: the first token's as first_token_timings.py says; `kv_transfer_seconds` runs from
the first token's arrival on this call to the end of the page write, by the transport named
in `kv_transport`; `kv_transfer_early_bytes` were written before it.

Spans (services/common/tracing.py), children of the call's server span: `host_tier.read`,
`prefill.queue` (arrival until the engine's first step with the request), one
`prefill.chunk` per forward pass over the prompt, and `kv.transfer`.

With a HostTierSource (the router found more of the prompt's prefix on a kvstore node
than here), the blocks this worker lacks are read from that node into its prefix cache
before the prompt is queued; after the handoff, the cached blocks it reused are stored
on its own kvstore node (`--kvstore`) before their pages are released (host_tier.py).

The write runs off the engine thread (a copy on a worker thread, or a gRPC stream):
held pages are neither reallocated nor written until `release`, so reading them is
safe there, and the engine keeps stepping other requests meanwhile.
"""
from __future__ import annotations

import asyncio
import logging
import time
from functools import partialmethod

import grpc
import torch

from engine.outputs import ComputedPages
from protos import prefill_pb2, prefill_pb2_grpc
from services.common import request_spans, tracing
from services.common.engine_errors import EngineDeadError
from services.common.engine_loop import EngineLoop
from services.common.grpc_server import EarlyHeaders, OpenedAhead
from services.common.metrics import ServiceMetrics
from services.common.prompt_embeds import given_inputs
from services.common.relayed_errors import relayed_from
from services.common.request_outputs import RequestRefusedError
from services.kvstore.host_id import host_id
from services.kvstore.layout import PageLayout
from services.kvstore.page_fence import ReservationEndedError
from services.prefill.config import DEFAULT_RESERVE_WAIT_S
from services.prefill.converters import (
    first_token_event,
    reserved_target,
    sampling_params_from_proto,
    transport_to_proto,
)
from services.prefill.decode_reservations import DecodeReservations
from services.prefill.early_pages import EarlyPages, EarlySending
from services.prefill.first_token_timings import first_token_timings
from services.prefill.held_pages import release_after
from services.prefill.host_tier import PrefillHostTier, holds_prefix_of
from services.prefill.kv_target import open_target
from services.prefill.kv_writer import KVWriter

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name
log = logging.getLogger("baton.prefill")
ENGINE_DEAD = "the prefill engine failed; the worker is stopping"


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    """`attach` is called once the engine is loaded; until then every call is UNAVAILABLE."""

    def __init__(self, kv_checksum: bool = True, early_kv_transfer: bool = True,
                 reserve_wait_s: float = DEFAULT_RESERVE_WAIT_S) -> None:
        self.kv_checksum = kv_checksum  # on GRPC_STREAM page chunks
        self.early_kv_transfer = early_kv_transfer  # a long prompt's pages sent as it computes
        self._early: EarlySending | None = None
        self.engine_loop: EngineLoop | None = None
        self.layout: PageLayout | None = None
        self._writer: KVWriter | None = None
        self._reservations = DecodeReservations(reserve_wait_s)  # waiting up to reserve_wait_s for pages there
        self._host_tier: PrefillHostTier | None = None
        self.opened_ahead = OpenedAhead("the prefill worker")  # PrefillPreopened's calls
        self.metrics = ServiceMetrics("prefill")  # until `attach` gives the service's
        self._host_id = host_id()  # whose monotonic clock stamps the first token's timings
        self.num_state_blocks = 0  # a hybrid model's pages of a request's recurrent states, after its tokens'

    def attach(self, engine_loop: EngineLoop, pool_tensor: torch.Tensor, layout: PageLayout,
               kvstore_address: str = "", metrics: ServiceMetrics | None = None, num_state_blocks: int = 0) -> None:
        """`pool_tensor`: our KV pool [L, 2, Hkv, N, bs, D]. `kvstore_address`: the kvstore node
        that computed prefix blocks are stored on ("": none). `num_state_blocks`: the pages of a request's
        recurrent states (a hybrid model's), handed over after its tokens' once its last chunk is computed (its
        tokens' pages may go early, as any model's: they do not change once computed); its prefixes are then not
        stored (a prefix's KV serves no other prompt without the states at its end)."""
        self.engine_loop = engine_loop
        self.layout = layout
        self.metrics = metrics or self.metrics
        self.num_state_blocks = num_state_blocks
        if num_state_blocks:
            kvstore_address = ""
        self._writer = KVWriter(pool_tensor, layout, host_id(), checksum=self.kv_checksum)
        self._early = EarlySending(self.early_kv_transfer, self._writer, self._reservations, layout.block_size)
        self._host_tier = PrefillHostTier(pool_tensor, layout, kvstore_address, checksum=self.kv_checksum)

    async def reset_host_tier(self) -> int:
        """A prefix-cache reset reaching this worker's kvstore node: the blocks it forgot."""
        return await self._host_tier.reset() if self._host_tier is not None else 0

    async def close(self) -> None:
        """Unmap the decode pools and close channels; after the server stopped (no write in flight)."""
        self.opened_ahead.close()
        if self._host_tier is not None:
            await self._host_tier.close()
        if self._writer is not None:
            await self._writer.close()
        await self._reservations.close()

    async def _ready(self, context) -> EngineLoop:
        if self.engine_loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill engine is still loading")
        if self.engine_loop.failure is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, ENGINE_DEAD)
        return self.engine_loop

    async def Prefill(self, request, context):
        """`_events` answered once: the first token's response, completed by the handoff."""
        response = None
        async for event in self._events(request, context):
            if event.HasField("first_token"):
                response = event.first_token
            else:
                response.reservation_id = event.handoff.reservation_id
                response.timings.CopyFrom(event.handoff.timings)
        return response

    async def _events(self, request, context, is_preopened: bool = False):
        """The first token (a `first_token` event), then, when the prompt goes on to decode, the
        pages written into the target (a `handoff` event). `is_preopened`: `request` is the call's
        request stream, and its first message the request. Counted: successes by finish reason
        ("prefilled": handed on to decode), failures by the status the call ended with."""
        if is_preopened:  # not a request until it comes: an idle call that ends is not counted
            request = await self.opened_ahead.first_request(context)
            if request is None:
                return
        is_added = False  # the engine may have the request: from just before it is handed over
        is_handed_on = False  # the decode worker now owns the reservation we made
        reservation: asyncio.Future | None = None  # our own Reserve on the decode worker, in flight
        pending_copy: asyncio.Future | None = None
        early: EarlyPages | None = None  # the pages sent while the prompt computes, if any
        held = None  # the "prefilled" output, while its pages are held
        try:
            arrival = time.perf_counter()
            arrival_ns = time.time_ns()
            received_monotonic_ns = time.monotonic_ns()
            engine_loop = await self._ready(context)
            request_id = request.request_id
            prompt = request.token_ids[:]  # a list: slicing makes it in one go, faster than list()
            output = request.output_token_ids[:]  # a moved request's, made before it moved
            if not request_id:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id must not be empty")
            if not prompt:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "token_ids must not be empty")
            try:
                params = sampling_params_from_proto(request.sampling)
                given = await given_inputs(request.sampling)
                await engine_loop.compile_guide(params)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            attrs = {}
            if tracing.is_enabled():
                attrs = tracing.request_attributes(request_id)
                tracing.set_current_attributes({**attrs, tracing.GEN_AI_REQUEST_MAX_TOKENS: params.max_tokens,
                                                tracing.GEN_AI_USAGE_INPUT_TOKENS: len(prompt)})
            num_tokens = len(prompt) + len(output)  # what the pages hold
            num_blocks = -(-num_tokens // self.layout.block_size) + self.num_state_blocks
            target = request.target
            if target.reservation_id:
                transport, dest = await open_target(self.layout, self._writer, target, num_blocks, context)
            elif not target.decode_address:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    "target needs a reservation_id, or a decode_address to reserve on")

            is_added = True  # unknown until its first output: cancelled meanwhile, it may have been added
            tier_tokens, tier_seconds = 0, 0.0
            try:
                if request.host_tier.num_blocks and request.host_tier.address and holds_prefix_of(params):
                    read_start = time.perf_counter()
                    with tracing.tracer().start_as_current_span("host_tier.read", attributes=attrs) as span:
                        tier_tokens = await self._host_tier.fill_prefix(engine_loop, request_id, prompt,
                                                                        request.host_tier.address,
                                                                        request.host_tier.num_blocks,
                                                                        params.cache_salt)
                        span.set_attribute(tracing.BATON_HOST_TIER_TOKENS, tier_tokens)
                    tier_seconds = time.perf_counter() - read_start
                early = self._early.pages_for(request_id, target, num_tokens, params.max_tokens - len(output),
                                              transport if target.reservation_id else None)
                outputs = engine_loop.add_request(request_id, prompt, params, prefill_only=True,
                                                  output_token_ids=output, reports_pages=early is not None,
                                                  given=given)
            except EngineDeadError:  # it failed since `_ready`
                is_added = False
                await context.abort(grpc.StatusCode.UNAVAILABLE, ENGINE_DEAD)
            headers = EarlyHeaders(context)
            if not is_preopened:  # a preopened call sent them as it was opened
                headers.send_soon()  # while the prompt computes: the first token goes without them
            out = await outputs.get()
            while isinstance(out, ComputedPages):  # a chunk of a long prompt: its pages go out meanwhile
                early.computed(out)
                out = await outputs.get()
            computed = time.perf_counter()
            await headers.sent()  # long since, as a rule: a message or an abort may follow now
            if isinstance(out, RequestRefusedError):
                is_added = False
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(out))
            if isinstance(out, EngineDeadError):  # queued behind the step that failed: it never ran
                is_added = False
                await context.abort(grpc.StatusCode.UNAVAILABLE, ENGINE_DEAD)
            if isinstance(out, Exception):
                await context.abort(grpc.StatusCode.INTERNAL, f"the prefill engine failed: {out}")
            if attrs:
                request_spans.record_queue("prefill.queue", arrival_ns, out.step_times, attrs)
                request_spans.record_prefill_chunks(out.step_times, attrs)
                tracing.set_current_attributes({tracing.BATON_CACHED_TOKENS: out.num_cached_tokens,
                                                tracing.BATON_HOST_TIER_TOKENS: tier_tokens})
            if out.finish_reason == "abort":
                await context.abort(grpc.StatusCode.ABORTED, f"request {request_id!r} was aborted")
            timings = first_token_timings(out.step_times, arrival_ns, arrival, computed, tier_seconds)
            timings.update(received_monotonic_ns=received_monotonic_ns, host_id=self._host_id,
                           first_token_sent_monotonic_ns=time.monotonic_ns())  # it goes out next
            first_token = first_token_event(out, params.logprobs, timings, tier_tokens, params.prompt_logprobs,
                                            params.logprob_token_ids)
            if out.finish_reason != "prefilled":  # the first token ended it: nothing to hand on
                yield first_token
                self.metrics.count_success(out.finish_reason)
                return
            held = out
            # The first token needs no pages, so it goes out before any are reserved: a Reserve
            # call made while the prompt computed slowed its forward pass by more than the call's
            # round trip (bench: ~2.4 ms of 35, on two vCPUs shared with the decode worker).
            yield first_token
            num_sent = await early.settle(out.num_preemptions) if early is not None else 0
            if not target.reservation_id:
                reservation = early.reservation if early is not None and early.reservation is not None else \
                    self._reservations.reserve(target.decode_address, request_id, num_tokens,
                                               may_wait=not target.reserve_at_once)
                try:
                    made = await asyncio.shield(reservation)  # a cancelled call still learns its answer
                except grpc.aio.AioRpcError as e:
                    await context.abort(e.code(), f"the decode worker could not reserve pages: {e.details()}",
                                        relayed_from("decode"))
                target = reserved_target(target, made)
                transport, dest = await open_target(self.layout, self._writer, target, num_blocks, context)
            src_blocks = out.held_block_ids[:num_blocks]
            write_start_ns = time.time_ns()
            # Shielded: a cancelled call must not release the pages while the write still reads them.
            pending_copy = asyncio.ensure_future(self._writer.write(transport, request_id, src_blocks[num_sent:],
                                                                    dest, start=num_sent))
            timings = prefill_pb2.PrefillTimings(**timings)
            try:
                timings.kv_transfer_early_bytes = early.num_bytes if early is not None else 0
                timings.kv_transfer_bytes = await asyncio.shield(pending_copy) + timings.kv_transfer_early_bytes
            except ReservationEndedError as e:  # as the Decode call would find it: the gateway prefills it again
                await context.abort(grpc.StatusCode.NOT_FOUND, f"cannot write the KV target: {e}")
            except ValueError as e:  # refused before writing anything (copy_pages checks first)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot write the KV target: {e}")
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), f"the decode worker refused the KV pages: {e.details()}",
                                    relayed_from("decode"))
            if attrs:
                tracing.soon(tracing.record_span, "kv.transfer", write_start_ns, time.time_ns(), {
                    **attrs, tracing.BATON_KV_TRANSPORT: transport.kind.value,
                    tracing.BATON_KV_BLOCKS: len(src_blocks), tracing.BATON_KV_BYTES: timings.kv_transfer_bytes})
            timings.kv_transport = transport_to_proto(transport.kind)
            timings.kv_transfer_seconds = time.perf_counter() - computed
            self._early.handed_over(target.decode_address, transport.kind)
            is_handed_on = True
            yield prefill_pb2.PrefillEvent(handoff=prefill_pb2.KVHandoff(reservation_id=target.reservation_id,
                                                                         timings=timings))
            self.metrics.count_success("prefilled")
        except (asyncio.CancelledError, GeneratorExit):
            self.metrics.count_error("cancelled")
            raise
        except BaseException:
            code = context.code()
            self.metrics.count_error(code.name.lower() if code is not None else "internal")
            raise
        finally:
            if early is not None:
                early.cancel()
                if reservation is None:  # made early, and the call ended before it was taken up
                    reservation = early.reservation
            if is_added:
                def release() -> None:
                    release_after(self.engine_loop, request_id, pending_copy)

                if held is None or not holds_prefix_of(params) or not self._host_tier.store_then(
                        request_id, prompt, held.num_cached_tokens, held.held_block_ids, release, params.cache_salt):
                    release()
            if reservation is not None and not is_handed_on:
                self._reservations.abort_after(reservation, request.target.decode_address, request_id)

    # gRPC iterates `_events` itself, not a generator passing its events on: each layer between them
    # is code run cold (the worker was idle) on the request's way in and the first token's way out.
    PrefillStream = _events
    # PrefillStream for the call's first message, whenever it comes.
    PrefillPreopened = partialmethod(_events, is_preopened=True)
