"""What a request can fail with before or while the mesh serves it, and how each failure is counted.

The HTTP and gRPC APIs map these to their errors (errors.py); the request metrics count
a failed request under `error_reason`.
"""
from __future__ import annotations

import asyncio

import grpc

from protos import common_pb2
from services.gateway.workers import NoHealthyWorkerError

# The sampling parameters a worker's refusal may begin with ("temperature must be >= 0, got -1.0",
# "logit_bias: token id 9000 is outside the vocabulary [0, 8192)": engine/sampling_params.py's and
# admission.py's words), as the APIs name them: the field an error body's `param` names. Not those
# the gateway fills in itself, nor those an API names otherwise (SGLang's label_token_ids): a refusal
# of one of them names the caller's default (the prompt).
REQUEST_SAMPLING_FIELDS = frozenset(common_pb2.SamplingParams.DESCRIPTOR.fields_by_name) - {
    "guide_after_token_id", "guide_after_token_ids", "images", "prompt_embeds", "stream_interval",
    "logprob_token_ids", "thinking_budget"}

UNTRUSTED_TEMPLATE = ("chat_template: this server renders conversations by the model's chat template only; a "
                      "request's own is taken where the gateway runs with --trust-request-chat-template")


class InvalidRequestError(ValueError):
    """The request itself is bad (HTTP 400); the message is safe to show the client. `param`: the
    field at fault, where it is not the prompt itself."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """The prompt plus the completion budget exceeds the model's context (HTTP 400)."""


class OverloadedError(RuntimeError):
    """No decode worker has the pages for this request now, or the gateway holds as many
    requests as it takes (HTTP 429; retry later)."""


def error_reason(e: BaseException) -> str:
    """The `reason` a failed request is counted under: as the HTTP API's error codes name
    it where they do (`context_length_exceeded`, `overloaded`, `unavailable`), else the
    failed call's gRPC code, `cancelled` when the consumer went away, `internal_error`."""
    if isinstance(e, (GeneratorExit, asyncio.CancelledError)):
        return "cancelled"
    if isinstance(e, ContextLengthError):
        return "context_length_exceeded"
    if isinstance(e, InvalidRequestError):
        return "invalid_request"
    if isinstance(e, OverloadedError):
        return "overloaded"
    if isinstance(e, NoHealthyWorkerError):
        return "unavailable"
    if isinstance(e, grpc.aio.AioRpcError):
        return e.code().name.lower()
    return "internal_error"


def from_rpc_error(e: grpc.aio.AioRpcError) -> Exception:
    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
        details = e.details() or ""
        field = details.split(" ", 1)[0].removesuffix(":")
        return InvalidRequestError(details, param=field if field in REQUEST_SAMPLING_FIELDS else None)
    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        details = e.details() or ""
        if "larger than max" in details:
            # gRPC's own words for a message over a channel's size limit ("Sent message ...", or "Received
            # message ...": the gateway's may be smaller than a worker's): the same request would fail again,
            # so not a 429 a client retries.
            what = "request to" if details.startswith("Sent") else "answer from"
            return InvalidRequestError(f"the {what} a worker is larger than a message carries (--max-message-bytes): "
                                       f"{details}")
        return OverloadedError(e.details())
    return e
