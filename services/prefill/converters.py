"""Protobuf ↔ engine types for the prefill service (only here and in the servicer).

Sampling parameters, layouts and logprobs convert exactly as the decode service's do,
so they are reused from there rather than written twice.
"""
from __future__ import annotations

from collections.abc import Sequence

from engine.outputs import RequestOutput
from protos import common_pb2, decode_pb2, prefill_pb2
from services.common.converters import (
    FINISH_REASONS,
    layout_from_proto,
    prompt_logprobs_to_proto,
    sampling_params_from_proto,
    top_logprobs,
)
from services.kvstore.transport import KVDestination, TransportKind

__all__ = ["destination_from_proto", "layout_from_proto", "first_token_event", "reserved_target",
           "sampling_params_from_proto", "transport_from_proto", "transport_to_proto"]

TRANSPORTS = {
    common_pb2.KV_TRANSPORT_SHARED_MEMORY: TransportKind.SHARED_MEMORY,
    common_pb2.KV_TRANSPORT_GRPC_STREAM: TransportKind.GRPC_STREAM,
    common_pb2.KV_TRANSPORT_CUDA_IPC: TransportKind.CUDA_IPC,
}


def first_token_event(out: RequestOutput, num_logprobs: int | None, timings: dict[str, float],
                      num_host_tier_tokens: int = 0,
                      num_prompt_logprobs: int | None = None,
                      logprob_token_ids: Sequence[int] = ()) -> prefill_pb2.PrefillEvent:
    """The first token of a finished prefill-only output, and `timings` (PrefillTimings' fields).
    "prefilled" (pages handed on, decode continues) leaves finish_reason UNSPECIFIED;
    "stop"/"length" set it. Built in one go, not from nested messages each copied into the next:
    it is on the first token's way out."""
    first = out.new_token_ids[0]  # a moved request came with output before it
    reason = None if out.finish_reason == "prefilled" else out.finish_reason
    event = prefill_pb2.PrefillEvent(first_token={
        "first_token_id": first, "num_cached_tokens": out.num_cached_tokens, "timings": timings,
        "finish_reason": FINISH_REASONS[reason], "num_host_tier_tokens": num_host_tier_tokens,
        "draft_token_ids": out.handoff_drafts})
    if num_logprobs is not None and out.new_logprobs:
        event.first_token.logprobs.CopyFrom(top_logprobs(first, out.new_logprobs[0], num_logprobs,
                                                          logprob_token_ids))
    if out.prompt_logprobs is not None:
        event.first_token.prompt_logprobs.extend(prompt_logprobs_to_proto(out.prompt_token_ids, out.prompt_logprobs,
                                                                          num_prompt_logprobs, logprob_token_ids))
    return event


def transport_from_proto(transport: int) -> TransportKind | None:
    """None for UNSPECIFIED (prefill chooses). Raises ValueError for a value this build does not know."""
    if transport == common_pb2.KV_TRANSPORT_UNSPECIFIED:
        return None
    if transport not in TRANSPORTS:
        raise ValueError(f"target.transport {transport} is not a known KV transport")
    return TRANSPORTS[transport]


def transport_to_proto(kind: TransportKind) -> int:
    return next(value for value, k in TRANSPORTS.items() if k is kind)


def destination_from_proto(target: prefill_pb2.KVTarget, num_blocks: int) -> KVDestination:
    """The target's first `num_blocks` pages (the prompt's) and the ways to reach them;
    transports this build does not know are left out of what it offers. (Its layout is
    not part of it: the servicer compares that with ours first.)"""
    return KVDestination(
        reservation_id=target.reservation_id, block_ids=tuple(target.block_ids[:num_blocks]),
        address=target.decode_address, shm_name=target.shm_name, cuda_ipc_handle=target.cuda_ipc_handle,
        host_id=target.decode_host_id,
        offered=frozenset(TRANSPORTS[t] for t in target.transports if t in TRANSPORTS))


def reserved_target(target: prefill_pb2.KVTarget, reservation: decode_pb2.Reservation) -> prefill_pb2.KVTarget:
    """`target` (a decode address and maybe a transport) completed by the reservation made there."""
    completed = prefill_pb2.KVTarget()
    completed.CopyFrom(target)
    completed.reservation_id = reservation.reservation_id
    completed.block_ids[:] = reservation.block_ids
    completed.shm_name = reservation.shm_name
    completed.layout.CopyFrom(reservation.layout)
    completed.cuda_ipc_handle = reservation.cuda_ipc_handle
    completed.decode_host_id = reservation.host_id
    completed.transports[:] = reservation.transports
    return completed
