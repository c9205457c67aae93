"""A request's steps as its prefill and decode workers' calls give them: the first token and the
handoff read off a PrefillStream, the following tokens off a Decode stream, what they tell of the
request on the way (`Progress`), and how the ledger and the metrics take each."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc

from protos import common_pb2, decode_pb2, prefill_pb2
from services.common.converters import FINISH_REASON_NAMES
from services.common.metrics import RequestMetrics
from services.common.relayed_errors import is_relayed_from
from services.gateway.timeline import PhaseClock


@dataclass
class Progress:
    """What a request's steps learned on the way, for its usage and its clean-up."""
    num_cached_tokens: int = 0
    is_released: bool = False  # the decode worker finished the request and freed its pages itself
    is_stopped_here: bool = False  # a stop string ended it before the decode worker did


def rpc_legs(timings: prefill_pb2.PrefillTimings, here: str, sent_ns: int, arrived_ns: int) -> dict[str, float] | None:
    """Two legs of the wait for a prefill worker's first token, in seconds: `to_prefill`, the prompt's
    way there (from before its write, `sent_ns`, to the worker having it), and `from_prefill`, the
    token's way back (from the worker sending it to the gateway having it, `arrived_ns`), by the
    worker's monotonic stamps and the gateway's. None when the worker is not on this host (`here`,
    its host id: its clock is another's) or stamped nothing."""
    if timings.host_id != here or not timings.received_monotonic_ns:
        return None
    return {"to_prefill": (timings.received_monotonic_ns - sent_ns) / 1e9,
            "from_prefill": (arrived_ns - timings.first_token_sent_monotonic_ns) / 1e9}


@dataclass
class Step:
    token_ids: list[int]
    logprobs: list
    finish_reason: str | None
    prefill_timings: prefill_pb2.PrefillTimings | None = None  # the first token's, from a prefill worker
    prompt_logprobs: Sequence[common_pb2.TopLogprobs] = ()  # the first step's, when asked for
    prefill_rpc_legs: dict[str, float] | None = None  # `rpc_legs` of the first token, when they can be told
    spec_decode: decode_pb2.SpecDecodeStats | None = None  # the last step's, from a worker that keeps them

    def settle(self, clock: PhaseClock, arrived: float) -> None:
        """Mark the wait for a prefill worker's first token on the ledger, up to `arrived` (a
        perf_counter()), as the worker's timings cut it up: once the token is out, not on its
        way. (A decode worker's steps are marked as they arrive.)"""
        t = self.prefill_timings
        if t is not None:
            clock.mark_split([("prefill_queue", t.queue_seconds - t.host_tier_read_seconds - t.admit_seconds),
                              ("host_tier_read", t.host_tier_read_seconds),
                              ("prefill_admit", t.admit_seconds),
                              ("prefill_compute", t.prefill_seconds)], rest="rpc", at=arrived)
        if self.prefill_rpc_legs is not None:
            clock.rpc_legs = self.prefill_rpc_legs


async def next_event(call, kind: str) -> prefill_pb2.PrefillEvent:
    """The next event of a PrefillStream call, which must be a `kind` one."""
    event = await call.read()
    if event is grpc.aio.EOF or event.WhichOneof("event") != kind:
        got = "the end of the stream" if event is grpc.aio.EOF else f"a {event.WhichOneof('event')} event"
        raise RuntimeError(f"the prefill worker sent {got} where a {kind} event was due")
    return event


async def read_to_end(call, within_s: float | None = None) -> None:
    """Read `call` to its end; cancelled if that takes longer than `within_s`."""
    try:
        async with asyncio.timeout(within_s):
            await _drain(call)
    except TimeoutError:
        call.cancel()


async def _drain(call) -> None:
    async for _ in call:
        pass


async def decode_steps(call, progress: Progress,
                        on_chunk: Callable[[decode_pb2.DecodeChunk], None]) -> AsyncIterator[Step]:
    first = True
    async for chunk in call:
        on_chunk(chunk)
        if first:
            progress.num_cached_tokens = progress.num_cached_tokens or chunk.num_cached_tokens
            first = False
        reason = FINISH_REASON_NAMES.get(chunk.finish_reason)
        progress.is_released = reason is not None
        yield Step(list(chunk.token_ids), list(chunk.logprobs), reason, prompt_logprobs=chunk.prompt_logprobs,
                   spec_decode=chunk.spec_decode if reason is not None and chunk.HasField("spec_decode") else None)


def observe_prefill(requests: RequestMetrics, timings: prefill_pb2.PrefillTimings,
                    legs: dict[str, float] | None) -> None:
    moved = timings.kv_transport != common_pb2.KV_TRANSPORT_UNSPECIFIED
    transport = common_pb2.KVTransport.Name(timings.kv_transport).removeprefix("KV_TRANSPORT_").lower()
    requests.observe_prefill(timings.queue_seconds, transport if moved else None, timings.kv_transfer_seconds,
                             timings.kv_transfer_bytes, legs, timings.kv_transfer_early_bytes)


def was_withheld(error: BaseException) -> bool:
    """A decode worker's call ended because it preempted the request, whose images' pixels it was not sent,
    and can compute their tokens no more (protos/decode.proto's DecodeRequest): ABORTED."""
    return isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.ABORTED


class PrefillHandoffError(grpc.aio.AioRpcError):
    """A prefill call's error after its first token, while its worker reserved or wrote the pages."""

    @classmethod
    def of(cls, error: grpc.aio.AioRpcError) -> PrefillHandoffError:
        return cls(error.code(), error.initial_metadata(), error.trailing_metadata(), error.details(),
                   error.debug_error_string())


def prefill_went_away(error: BaseException) -> bool:
    """A prefill call ended after its first token because its worker went away (UNAVAILABLE, not its decode
    worker's handed on): its decode worker may be as good as ever."""
    return isinstance(error, PrefillHandoffError) and went_away(error) and not is_relayed_from(error, "decode")


def found_no_pages(error: BaseException) -> bool:
    """A prefill worker's Reserve found too few free pages on the decode worker within its wait (or the
    prompt needs more than that worker's whole pool): RESOURCE_EXHAUSTED, after the first token."""
    return isinstance(error, PrefillHandoffError) and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def lost_its_pages(error: BaseException) -> bool:
    """A Decode call found no reservation for it: the pages prefill wrote were freed when the reservation's
    lease ran out before the call came (a gateway stalled that long): NOT_FOUND."""
    return isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.NOT_FOUND


def went_away(error: BaseException) -> bool:
    """A worker's call ended because the worker is gone or going (it stopped, died, or its engine failed
    on another request): UNAVAILABLE."""
    return isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.UNAVAILABLE
