"""The Decode gRPC service (protos/decode.proto) over one EngineLoop.

Status codes:
- INVALID_ARGUMENT: bad input (empty request id, zero tokens, a prompt longer than
  the context, sampling values out of range, a request id already in use).
- NOT_FOUND: Decode names a reservation that is unknown, expired, already claimed
  or held for another request id.
- RESOURCE_EXHAUSTED: Reserve finds too few free pages, now or, for one that may wait (its wait_ms),
  by the end of its wait (reserve_queue.py); at once for more than the whole pool (retry elsewhere).
- UNAVAILABLE: the engine is still loading and warming up, or has failed (the worker is stopping),
  also for a call whose engine work was still queued behind the step that failed: it never ran; a
  Reserve waiting for pages when the worker is told to stop.
- INTERNAL: the engine failed in a step that was running the request.

Pages are freed on finish, Abort, lease expiry and client cancellation of Decode or
GenerateLocally (which prefills a short prompt here instead of on a prefill worker); a reservation's
only once no prefill process is copying into them (fenced_reservations.py).
An Abort that names a finish reason (the gateway matched a stop string) ends the request
as finished for that reason: its stream's last chunk carries it, and it is counted so.

Metrics: Reserve calls waiting for pages (`baton_kv_reserves_waiting`); requests finished by finish
reason, and errors by reason: `unavailable`,
`invalid_argument`, `no_free_pages` (Reserve refused), `reservation_not_found`,
`lease_expired`, `pages_fenced` (a reservation ended while a prefill process copied into its pages),
`aborted` (an Abort without a finish reason ended a running request),
`cancelled` (its caller went away), `engine_failed`.

A chunk holds the tokens of one or more engine steps: the request's stream interval, and steps
merged behind a slow write (output_batches.py). The first chunk of Decode and GenerateLocally
carries DecodeTimings: the queue from the call's arrival to the engine's first step with the
request, and GenerateLocally's local prefill. Spans (services/common/tracing.py), children of
the call's server span: `decode.queue`, then `decode.first_step` (Decode) or `decode.prefill` with a
`prefill.chunk` per forward pass (GenerateLocally); the server span gets the token usage.
Both streams send their response headers ahead of the first chunk
(services/common/grpc_server.EarlyHeaders). DecodePreopened is Decode on a call the gateway
opened ahead of its request, which is the call's first message (its headers went out as it
was opened: services/common/grpc_server.OpenedAhead).
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from protos import common_pb2, decode_pb2, decode_pb2_grpc
from services.common.converters import layout_to_proto, sampling_params_from_proto
from services.common.engine_errors import EngineDeadError
from services.common.engine_loop import EngineLoop
from services.common.grpc_server import OpenedAhead
from services.common.metrics import ServiceMetrics
from services.common.prompt_embeds import given_inputs
from services.decode.decode_chunks import CallPhases, decode_chunks
from services.decode.fenced_reservations import FencedReservations
from services.decode.leases import Lease, LeaseTable
from services.decode.output_batches import OutputBatches
from services.decode.reserve_queue import ReserveQueue, WorkerStopping
from services.kvstore.host_id import host_id
from services.kvstore.layout import PageLayout
from services.kvstore.page_fence import PageFence

SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name
ENGINE_DEAD = "the decode engine failed; the worker is stopping"
log = logging.getLogger("baton.decode")


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    """`attach` is called once the engine is loaded; until then every call is UNAVAILABLE."""

    def __init__(self, lease_ms: int) -> None:
        self.lease_ms = lease_ms
        self.engine_loop: EngineLoop | None = None
        self.leases: LeaseTable | None = None
        self.reserved_pages: FencedReservations | None = None
        self.layout: PageLayout | None = None
        self.shm_name = ""
        self.cuda_ipc_handle = b""
        self.transports: list[int] = []
        self.host_id = host_id()
        self.metrics = ServiceMetrics("decode")  # until `attach` gives the service's
        self._streaming: dict[str, CallPhases] = {}  # request id -> its Decode or GenerateLocally call, while it runs
        self.opened_ahead = OpenedAhead("the decode worker")  # DecodePreopened's calls
        self.reserves = ReserveQueue()  # Reserve calls waiting for pages

    def attach(self, engine_loop: EngineLoop, layout: PageLayout, metrics: ServiceMetrics, fence: PageFence, *,
               shm_name: str = "", cuda_ipc_handle: bytes = b"") -> None:
        """Must run on the server's event loop (the lease timers live there). The pool is reached on this host
        through its segment `shm_name` (a CPU pool) or `cuda_ipc_handle` (a GPU pool), from any by the stream;
        `fence` is its pages' (the segment's, or the GPU pool's fence segment)."""
        self.engine_loop = engine_loop
        self.reserved_pages = FencedReservations(engine_loop, fence, metrics)
        self.layout = layout
        self.shm_name = shm_name
        self.cuda_ipc_handle = cuda_ipc_handle
        self.transports = [common_pb2.KV_TRANSPORT_GRPC_STREAM]
        if cuda_ipc_handle:
            self.transports.insert(0, common_pb2.KV_TRANSPORT_CUDA_IPC)
        if shm_name:
            self.transports.insert(0, common_pb2.KV_TRANSPORT_SHARED_MEMORY)
        self.metrics = metrics
        metrics.gauge("baton_kv_reserves_waiting", "Reserve calls waiting for pages to free (their wait_ms), "
                      "first come first served").labels(**metrics.labels).set_function(
            lambda: self.reserves.num_waiting)
        self.leases = LeaseTable(self.lease_ms / 1000, self._on_lease_expired)

    def close(self) -> None:
        self.opened_ahead.close()
        if self.leases is not None:
            self.leases.close()
        if self.reserved_pages is not None:
            self.reserved_pages.close()

    async def _ready(self, context) -> EngineLoop:
        if self.engine_loop is None:
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, "the decode engine is still loading")
        if self.engine_loop.failure is not None:
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, ENGINE_DEAD)
        return self.engine_loop

    async def _abort(self, context, code: grpc.StatusCode, details: str, reason: str | None = None) -> None:
        """`context.abort`, counted as an error under `reason` (default: the code's name)."""
        self.metrics.count_error(reason or code.name.lower())
        await context.abort(code, details)

    def _on_lease_expired(self, lease: Lease) -> None:
        log.info("reservation for %r expired unclaimed; its pages are freed", lease.request_id)
        self.metrics.count_error("lease_expired")
        self.engine_loop.submit(self.reserved_pages.ending(lease))

    async def Reserve(self, request, context):
        engine_loop = await self._ready(context)
        if not request.request_id:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "request_id must not be empty")
        if request.num_tokens < 1:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "num_tokens must be >= 1")
        try:
            block_ids = await self.reserves.reserve(lambda: self._reserve_now(engine_loop, request),
                                                    request.wait_ms / 1000)
        except ValueError as e:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineDeadError:  # before the RuntimeError it is: a dead engine is not out of pages
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, ENGINE_DEAD)
        except RuntimeError as e:
            await self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), "no_free_pages")
        except WorkerStopping as e:  # the request goes to another decode worker (the gateway's DecodeMoves)
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
        reservation_id = self.leases.grant(request.request_id, block_ids)
        self.reserved_pages.granted(reservation_id, block_ids)
        return decode_pb2.Reservation(
            reservation_id=reservation_id, block_ids=block_ids, lease_ms=self.lease_ms,
            layout=layout_to_proto(self.layout), shm_name=self.shm_name, cuda_ipc_handle=self.cuda_ipc_handle,
            transports=self.transports,
            host_id=self.host_id,
        )

    @staticmethod
    async def _reserve_now(engine_loop: EngineLoop, request: decode_pb2.ReserveRequest) -> list[int]:
        """The pages, if the engine has them free now. A call cancelled meanwhile (its caller went away
        or its deadline passed) has whatever the engine still reserves for it given back."""
        reserving = asyncio.ensure_future(engine_loop.reserve(request.request_id, request.num_tokens))
        try:
            return await asyncio.shield(reserving)
        except asyncio.CancelledError:
            def give_back(done: asyncio.Future) -> None:
                if not done.cancelled() and done.exception() is None:
                    asyncio.ensure_future(engine_loop.release_reservation(request.request_id))
            reserving.add_done_callback(give_back)
            raise

    async def DecodePreopened(self, request_iterator, context):
        """Decode for the call's first message, whenever it comes."""
        request = await self.opened_ahead.first_request(context)
        if request is not None:
            async for chunk in self._decode(request, context, are_headers_sent=True):
                yield chunk

    async def Decode(self, request, context):
        async for chunk in self._decode(request, context):
            yield chunk

    async def _decode(self, request, context, are_headers_sent: bool = False):
        arrival_ns = time.time_ns()
        engine_loop = await self._ready(context)
        try:
            params = sampling_params_from_proto(request.sampling)
            given = await given_inputs(request.sampling)
            # before the claim: a refusal leaves the reservation be
            await engine_loop.compile_guide(params)
        except ValueError as e:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        lease = self.leases.claim(request.reservation_id, request.request_id)
        if lease is None:
            await self._abort(context, grpc.StatusCode.NOT_FOUND,
                              f"no reservation {request.reservation_id!r} for request {request.request_id!r} "
                              "(unknown, expired or already claimed)", "reservation_not_found")
        self.reserved_pages.claimed(lease)
        try:
            started = engine_loop.start_prefilled(request.request_id, list(request.prompt_token_ids),
                                                  request.first_token_id, params, list(request.output_token_ids),
                                                  given, list(request.draft_token_ids))
            phases = CallPhases(request.request_id, arrival_ns, len(request.prompt_token_ids), params.max_tokens,
                             is_local=False)
            outputs = OutputBatches(started, request.sampling.stream_interval, is_first_token_sent=True)
            async for chunk in decode_chunks(engine_loop, request.request_id, outputs, params, context,
                                       self.metrics, phases, self._streaming, are_headers_sent):
                yield chunk
        except ValueError as e:  # refused: the reservation was released with the refusal
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineDeadError:  # it failed since `_ready`
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, ENGINE_DEAD)

    async def GenerateLocally(self, request, context):
        arrival_ns = time.time_ns()
        engine_loop = await self._ready(context)
        if not request.request_id:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "request_id must not be empty")
        try:
            params = sampling_params_from_proto(request.sampling)
            given = await given_inputs(request.sampling)
            await engine_loop.compile_guide(params)
        except ValueError as e:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            started = engine_loop.add_request(request.request_id, list(request.prompt_token_ids), params,
                                              output_token_ids=list(request.output_token_ids),
                                              given=given)
            phases = CallPhases(request.request_id, arrival_ns, len(request.prompt_token_ids), params.max_tokens,
                             is_local=True)
            outputs = OutputBatches(started, request.sampling.stream_interval,
                                    is_first_token_sent=bool(request.output_token_ids))
            async for chunk in decode_chunks(engine_loop, request.request_id, outputs, params, context,
                                       self.metrics, phases, self._streaming):
                yield chunk
        except ValueError as e:  # an empty prompt, a token outside the vocabulary, no room in the context
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineDeadError:  # it failed since `_ready`
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, ENGINE_DEAD)

    async def Abort(self, request, context):
        engine_loop = await self._ready(context)
        try:
            lease = self.leases.revoke(request.request_id)
            if lease is not None:
                found = await engine_loop.call(self.reserved_pages.ending(lease))
            else:
                call = self._streaming.get(request.request_id)
                if call is not None:  # noted first: the call may read the aborted output before this resumes
                    call.finished_by_caller = request.finish_reason
                found = await engine_loop.abort(request.request_id)
        except EngineDeadError:
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, ENGINE_DEAD)
        return decode_pb2.AbortResponse(found=found)
