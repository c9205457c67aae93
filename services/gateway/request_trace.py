"""One request's spans on the gateway: a span per choice under the HTTP request's span
(`gen_ai.operation.name` and `gen_ai.request.*` attributes, usage and finish reason when it
ends), `tokenize` and `route` under it, and the calls to the tokenizer, prefill and decode
made while it is current, so the workers' spans join the same trace. The first token is an
event on it.

The pipeline is an async generator: a span made current across one of its `yield`s would
leak into the consumer's context. So the choice's span is current only around the calls'
creation (`calls`), whose interceptors copy that context. `tokenize` and `route` are timed
on the way and recorded when the request ends: a span costs 50-150 µs of Python here, and
the first token should not wait for them.

With tracing off every method is a no-op on a shared object: a request pays a few calls.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from opentelemetry import trace

from protos import common_pb2
from services.common import tracing


class RequestTrace:
    """The spans of one choice (one request on the mesh)."""

    def __init__(self, span: trace.Span, request_id: str = "", operation: str = "",
                 params: common_pb2.SamplingParams | None = None) -> None:
        self.span = span
        self.request_id = request_id
        self.operation = operation
        self.params = params  # its attributes are set when the request ends, off its path
        self._phases: list[tuple[str, int, int]] = []  # (name, start, end), recorded at the end

    @classmethod
    def start(cls, request_id: str, operation: str, params: common_pb2.SamplingParams) -> RequestTrace:
        """`operation`: "chat" or "text_completion"; the current span (the HTTP request's) is the parent."""
        if not tracing.is_enabled():
            return NO_TRACE
        span = tracing.tracer().start_span(f"{operation} {tracing.served_model()}".strip(),
                                           kind=trace.SpanKind.INTERNAL)
        return cls(span, request_id, operation, params)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A child span over the block, recorded when the request ends; the calls made inside
        are children of the choice's span."""
        start_ns = time.time_ns()
        with self.calls():
            yield
        self._phases.append((name, start_ns, time.time_ns()))

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
        span, params = self.span, self.params
        span.set_attributes(tracing.request_attributes(self.request_id, {
            tracing.GEN_AI_OPERATION_NAME: self.operation,
            tracing.GEN_AI_REQUEST_MAX_TOKENS: params.max_tokens if params.HasField("max_tokens") else None,
            tracing.GEN_AI_REQUEST_TEMPERATURE: params.temperature if params.HasField("temperature") else None,
            tracing.GEN_AI_REQUEST_TOP_P: params.top_p if params.HasField("top_p") else None,
            tracing.GEN_AI_REQUEST_SEED: params.seed if params.HasField("seed") else None,
            tracing.GEN_AI_RESPONSE_ID: self.request_id,
            tracing.GEN_AI_USAGE_INPUT_TOKENS: num_prompt_tokens,
            tracing.GEN_AI_USAGE_OUTPUT_TOKENS: num_output_tokens}))
        if status != "finished":
            span.set_status(trace.Status(trace.StatusCode.ERROR, status))
        end_ns = time.time_ns()
        for name, start_ns, phase_end_ns in self._phases:
            tracing.record_span(name, start_ns, phase_end_ns, parent=span)
        span.end(end_time=end_ns)


class _NoTrace(RequestTrace):
    """Tracing off: nothing recorded, nothing made current. Its blocks are one shared
    nullcontext, not a generator made and run for each (a request's path goes through five)."""

    def __init__(self) -> None:
        super().__init__(trace.INVALID_SPAN)

    def phase(self, name: str) -> AbstractContextManager[None]:
        return _NOTHING

    def calls(self) -> AbstractContextManager[None]:
        return _NOTHING

    def first_token(self) -> None:
        pass

    def finish_reason(self, reason: str, num_cached_tokens: int) -> None:
        pass

    def end(self, status: str, num_prompt_tokens: int, num_output_tokens: int) -> None:
        pass


_NOTHING = nullcontext()
NO_TRACE = _NoTrace()
