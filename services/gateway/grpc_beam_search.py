"""Beam search by the public gRPC API (`GenerateRequest.beam_search`), the HTTP API's `use_beam_search`
(beam_search.py) over the same pipeline: the `n` best beams as the request's choices, best first,
each whole. Refused as the HTTP API refuses it: with what would change the model's logprobs or end
a beam on its text, named by its field."""
from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from typing import Any

from protos import common_pb2, gateway_pb2
from services.gateway.beam_search import MAX_BEAM_WIDTH, beam_choices, beam_search
from services.gateway.deltas import Delta
from services.gateway.errors import APIError
from services.gateway.openai_protocol import NOT_WITH_BEAM_SEARCH
from services.gateway.pipeline import RequestPipeline
from services.gateway.structured_output import is_guided
from services.gateway.timeline import ResponseTimeline

REQUEST_FIELDS = ("stop", "stop_regex")  # the request's own, not its SamplingParams' (as in the HTTP API)
PROTO_NAMES = {"thinking_token_budget": "thinking_budget"}  # the HTTP API's names the SamplingParams spell otherwise


def check_beam_search(request: gateway_pb2.GenerateRequest, sampling: common_pb2.SamplingParams) -> None:
    """APIError (400) naming the first field that `request` (a beam search) sets and a search cannot
    honour. `sampling`: what the request is sampled with (a forced tool call's guide written in);
    the generation defaults of the model's own config are not held against it, as the HTTP API
    does not apply them to a search."""
    if request.n > MAX_BEAM_WIDTH:
        raise APIError(400, f"at most {MAX_BEAM_WIDTH} beams (n) with beam_search, got {request.n}", param="n")
    length_penalty = request.beam_search.length_penalty
    if not math.isfinite(length_penalty):
        raise APIError(400, f"beam_search.length_penalty must be a finite number, got {length_penalty}",
                       param="beam_search.length_penalty")
    for name in map(lambda name: PROTO_NAMES.get(name, name), NOT_WITH_BEAM_SEARCH):  # the HTTP API's refusals
        param = name if name in REQUEST_FIELDS else f"sampling.{name}"
        if _asks_for(request, name):
            raise APIError(400, f"{param} is not supported with beam_search", param=param)
    if is_guided(sampling):
        raise APIError(400, "structured output (a guide or a forced tool call) is not supported with beam_search",
                       param="beam_search")


def _asks_for(request: gateway_pb2.GenerateRequest, name: str) -> bool:
    """Whether `request` sets `name` (one of REQUEST_FIELDS, or a sampling field) to anything but what asks
    for nothing."""
    if name in REQUEST_FIELDS:
        return bool(getattr(request, name))
    if name == "repetition_penalty":  # absent or 1: off
        return request.sampling.HasField(name) and request.sampling.repetition_penalty != 1
    if name == "thinking_budget":  # a message: present is asked for, a budget of 0 too
        return request.sampling.HasField(name)
    return bool(getattr(request.sampling, name))


def beam_search_choices(pipeline: RequestPipeline, request: gateway_pb2.GenerateRequest, request_id: str,
                        shared: dict[str, Any], timeline: ResponseTimeline,
                        on_dispatch: Callable[[], None]) -> AsyncIterator[tuple[int, Delta]]:
    """The request's beams as (index, delta), once the search is done. `shared`: the pipeline's
    arguments as the servicer built them for a sampled request."""
    check_beam_search(request, shared["sampling"])
    search = request.beam_search
    inputs = {name: shared[name] for name in ("prompt_text", "prompt_token_ids", "messages", "chat_options")
              if name in shared}
    return beam_choices([beam_search(
        pipeline, request_id, shared["sampling"], max(request.n, 1),
        search.length_penalty if search.HasField("length_penalty") else 1.0, **inputs,
        num_logprobs=request.sampling.logprobs if request.sampling.HasField("logprobs") else None,
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=shared["skip_special_tokens"], timeline=timeline, on_dispatch=on_dispatch)])
