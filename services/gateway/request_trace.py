"""One request's spans on the gateway: a span per choice under the HTTP request's span
(`gen_ai.operation.name` and `gen_ai.request.*` attributes, usage and finish reason when it
ends), `tokenize` and `route` under it, and the prefill and decode calls made while it is
current, so their client spans, and the workers' spans under those, join the same trace.
The first token is an event on it.

The pipeline is an async generator: a span made current across one of its `yield`s would
leak into the consumer's context. So the choice's span is current only around code that
does not yield (`phase`, `calls`), and the calls' interceptors copy that context when the
call is created.

With tracing off every method is a no-op on a shared object: a request pays a few calls.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace

from protos import common_pb2
from services.common import tracing


class RequestTrace:
    """The spans of one choice (one request on the mesh)."""

    def __init__(self, span: trace.Span) -> None:
        self.span = span

    @classmethod
    def start(cls, request_id: str, operation: str, params: common_pb2.SamplingParams) -> RequestTrace:
        """`operation`: "chat" or "text_completion"; the current span (the HTTP request's) is the parent."""
        if not tracing.is_enabled():
            return NO_TRACE
        attributes = tracing.request_attributes(request_id, {
            tracing.GEN_AI_OPERATION_NAME: operation,
            tracing.GEN_AI_REQUEST_MAX_TOKENS: params.max_tokens if params.HasField("max_tokens") else None,
            tracing.GEN_AI_REQUEST_TEMPERATURE: params.temperature if params.HasField("temperature") else None,
            tracing.GEN_AI_REQUEST_TOP_P: params.top_p if params.HasField("top_p") else None,
            tracing.GEN_AI_REQUEST_SEED: params.seed if params.HasField("seed") else None,
            tracing.GEN_AI_RESPONSE_ID: request_id})
        model = attributes.get(tracing.GEN_AI_REQUEST_MODEL, "")
        span = tracing.tracer().start_span(f"{operation} {model}".strip(), kind=trace.SpanKind.INTERNAL,
                                           attributes=attributes)
        return cls(span)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A child span around code that does not yield; current inside it."""
        with tracing.tracer().start_as_current_span(name, context=trace.set_span_in_context(self.span)):
            yield

    @contextmanager
    def calls(self) -> Iterator[None]:
        """This choice's span is current: gRPC calls created inside join its trace."""
        with trace.use_span(self.span, end_on_exit=False):
            yield

    def first_token(self) -> None:
        self.span.add_event("first_token")

    def finish_reason(self, reason: str, num_cached_tokens: int) -> None:
        self.span.set_attributes({tracing.GEN_AI_RESPONSE_FINISH_REASONS: [reason],
                                  tracing.BATON_CACHED_TOKENS: num_cached_tokens})

    def end(self, status: str, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """`status`: "finished", or the reason the request failed (the span's error status)."""
        span = self.span
        span.set_attributes({tracing.GEN_AI_USAGE_INPUT_TOKENS: num_prompt_tokens,
                             tracing.GEN_AI_USAGE_OUTPUT_TOKENS: num_output_tokens})
        if status != "finished":
            span.set_status(trace.Status(trace.StatusCode.ERROR, status))
        span.end(end_time=time.time_ns())


class _NoTrace(RequestTrace):
    """Tracing off: nothing recorded, nothing made current."""

    def __init__(self) -> None:
        super().__init__(trace.INVALID_SPAN)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield

    @contextmanager
    def calls(self) -> Iterator[None]:
        yield

    def first_token(self) -> None:
        pass

    def finish_reason(self, reason: str, num_cached_tokens: int) -> None:
        pass

    def end(self, status: str, num_prompt_tokens: int, num_output_tokens: int) -> None:
        pass


NO_TRACE = _NoTrace()
