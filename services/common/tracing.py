"""OpenTelemetry tracing: the one place a Baton process sets it up.

On when `setup_tracing` is given an endpoint (a service's `--otlp-endpoint`) or the standard
variables ask for it (`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` set,
`OTEL_SDK_DISABLED` not "true", `OTEL_TRACES_EXPORTER` not "none"). Then spans go, batched,
to an OTLP gRPC collector, and the other `OTEL_*` variables (sampler, batch sizes, headers,
resource attributes, `OTEL_SERVICE_NAME`) apply as the SDK reads them.

Off, nothing is installed: `tracer()` is the API's no-op tracer, the interceptor lists are
empty (channels and servers are built exactly as without tracing) and `record_span` returns
at once, so a request pays for a few no-op calls at most.

One trace per request: every gRPC server span continues the caller's W3C `traceparent` from
the call's metadata (`server_interceptors`), and every client call carries the current
span's (`client_interceptors`; both in grpc_tracing.py). Phases measured on an engine thread, known only afterwards
(queue time, each prefill chunk), are recorded with explicit times by `record_span`.
Health and reflection calls are not traced.
"""
from __future__ import annotations

import asyncio
import atexit
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry import context as otel_context, trace

log = logging.getLogger("baton.tracing")

TRACER_NAME = "baton"

# Attribute names, after the OpenTelemetry GenAI semantic conventions where one exists.
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
BATON_REQUEST_ID = "baton.request_id"
BATON_CACHED_TOKENS = "baton.cached_tokens"          # prompt tokens from the prefix cache
BATON_HOST_TIER_TOKENS = "baton.host_tier_tokens"    # prompt tokens read from a kvstore node
BATON_CHUNK_INDEX = "baton.chunk.index"
BATON_CHUNK_TOKENS = "baton.chunk.num_tokens"        # prompt tokens computed in one forward pass
BATON_BATCH_SEQS = "baton.batch.num_seqs"            # requests in that forward pass
BATON_IMAGES = "baton.images.count"                  # a request's images encoded at once
BATON_IMAGE_TOKENS = "baton.images.num_tokens"       # the prompt tokens their rows take
BATON_KV_TRANSPORT = "baton.kv.transport"
BATON_KV_BYTES = "baton.kv.bytes"
BATON_KV_BLOCKS = "baton.kv.num_blocks"
BATON_INSTANCE_ID = "baton.instance_id"

# Not traced: probed every few hundred milliseconds, and part of no request.
_UNTRACED_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                      "grpc.reflection.v1.ServerReflection")

_NO_OP_TRACER = trace.NoOpTracer()  # off means off, whatever global provider a library installed

_provider: Any = None  # the SDK TracerProvider while tracing is on
_tracer: trace.Tracer | None = None  # its tracer
_model = ""
_is_global_set = False


def is_requested(endpoint: str | None = None, env: Mapping[str, str] = os.environ) -> bool:
    """Whether `endpoint` or the standard variables turn tracing on."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return bool(endpoint or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def setup_tracing(service: str, instance: str = "", model: str = "", endpoint: str | None = None) -> bool:
    """Install a global SDK TracerProvider exporting to `endpoint` (or where `OTEL_*` says) when
    tracing is requested; return whether it is on. Resource: `service.name` = `baton-<service>`
    (unless `OTEL_SERVICE_NAME` names one), `service.instance.id` = `instance`. `model` is the
    `gen_ai.request.model` that `request_attributes` adds. Calling it again replaces the provider
    (flushing the old one). Call before building servers and channels: their interceptors are
    chosen when they are built."""
    global _provider, _tracer, _model, _is_global_set
    if not is_requested(endpoint):
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    shutdown_tracing()
    attributes = {SERVICE_INSTANCE_ID: instance or f"{service}-{os.getpid()}"}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attributes[SERVICE_NAME] = f"baton-{service}"
    if endpoint and "://" not in endpoint:
        endpoint = f"http://{endpoint}"  # a bare host:port means plaintext, as the rest of the mesh speaks
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint or None)))
    _provider, _tracer, _model = provider, provider.get_tracer(TRACER_NAME), model
    if not _is_global_set:  # the API allows one global provider per process; ours delegate to `_provider`
        trace.set_tracer_provider(provider)
        _is_global_set = True
    atexit.register(shutdown_tracing)
    log.info("tracing on: spans of %s go to %s", f"baton-{service}",
             endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
             or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    return True


def is_enabled() -> bool:
    return _provider is not None


def served_model() -> str:
    """The `gen_ai.request.model` given to `setup_tracing` ("" while tracing is off)."""
    return _model


def tracer() -> trace.Tracer:
    """Baton's tracer: the SDK's while tracing is on, else the API's no-op one."""
    return _tracer if _tracer is not None else _NO_OP_TRACER


def shutdown_tracing() -> None:
    """Export what is still batched and stop; idempotent, and a no-op while tracing is off."""
    global _provider, _tracer
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


def client_interceptors() -> list:
    """For `grpc.aio` channels: the current span's context in every call's metadata.
    Empty while tracing is off."""
    if _provider is None:
        return []
    from services.common import grpc_tracing

    return grpc_tracing.client_interceptors()


def server_interceptors() -> list:
    """For `grpc.aio` servers: a server span per call, continuing the caller's trace from the
    call's metadata and current while the servicer runs. Empty while tracing is off."""
    if _provider is None:
        return []
    from services.common.grpc_tracing import ServerSpanInterceptor

    return [ServerSpanInterceptor(tracer(), untraced=_UNTRACED_SERVICES)]


def record_span(name: str, start_ns: int, end_ns: int, attributes: Mapping[str, Any] | None = None,
                parent: otel_context.Context | trace.Span | None = None) -> trace.Span:
    """A finished span from `start_ns` to `end_ns` (wall clock, `time.time_ns()`), child of
    `parent` (a Context or a Span; None: the current span). Returns it, to parent others on;
    the invalid span while tracing is off."""
    if _provider is None:
        return trace.INVALID_SPAN
    if isinstance(parent, trace.Span):
        parent = trace.set_span_in_context(parent)
    span = tracer().start_span(name, context=parent, attributes=attributes, start_time=start_ns)
    span.end(end_time=max(end_ns, start_ns))
    return span


# How long `soon` waits: past the response in hand (a unary call's reply, a first token) going
# out. A span costs 50-150 µs of Python on a small host, and the request should not wait
# for the spans that describe it.
RECORD_DELAY_S = 0.02


def soon(record: Callable[..., Any], *args: Any) -> None:
    """`record(*args)` RECORD_DELAY_S from now on the running loop, in a copy of the current
    context (so the current span is still the parent); at once outside an event loop."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        record(*args)
        return
    loop.call_later(RECORD_DELAY_S, record, *args)


def request_attributes(request_id: str, attributes: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`baton.request_id`, `gen_ai.request.model` (the served model) and `attributes` (None
    values left out), for a request's spans."""
    out: dict[str, Any] = {BATON_REQUEST_ID: request_id}
    if _model:
        out[GEN_AI_REQUEST_MODEL] = _model
    if attributes:
        out.update((k, v) for k, v in attributes.items() if v is not None)
    return out


def set_current_attributes(attributes: Mapping[str, Any]) -> None:
    """Set `attributes` on the current span (the RPC's server span in a servicer); no-op while off."""
    if _provider is not None:
        trace.get_current_span().set_attributes(attributes)


def record_engine_boot(boot_times: Mapping[str, tuple[int, int]]) -> None:
    """An engine's start-up phases (`LLMEngine.boot_times`) under the current span (`boot`):
    `engine_init`, with the others (`weights`, `kv_pool`) beneath it."""
    if _provider is None or "engine_init" not in boot_times:
        return
    init = record_span("engine_init", *boot_times["engine_init"])
    for name, (start_ns, end_ns) in boot_times.items():
        if name != "engine_init":
            record_span(name, start_ns, end_ns, parent=init)
