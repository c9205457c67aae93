"""Protobuf ↔ engine types for the prefill service (only here and in the servicer).

Sampling parameters, layouts and logprobs convert exactly as the decode service's do,
so they are reused from there rather than written twice.
"""
from __future__ import annotations

from engine.outputs import RequestOutput
from protos import prefill_pb2
from services.common.converters import (
    FINISH_REASONS,
    layout_from_proto,
    sampling_params_from_proto,
    top_logprobs,
)

__all__ = ["layout_from_proto", "response_from_output", "sampling_params_from_proto"]


def response_from_output(out: RequestOutput, num_logprobs: int | None,
                         timings: prefill_pb2.PrefillTimings) -> prefill_pb2.PrefillResponse:
    """The first token of a finished prefill-only output. "prefilled" (pages handed on,
    decode continues) leaves finish_reason UNSPECIFIED; "stop"/"length" set it."""
    first = out.token_ids[0]
    reason = None if out.finish_reason == "prefilled" else out.finish_reason
    response = prefill_pb2.PrefillResponse(first_token_id=first, num_cached_tokens=out.num_cached_tokens,
                                           timings=timings, finish_reason=FINISH_REASONS[reason])
    if num_logprobs is not None and out.new_logprobs:
        response.logprobs.CopyFrom(top_logprobs(first, out.new_logprobs[0], num_logprobs))
    return response

