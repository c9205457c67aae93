"""The OpenAI-compatible HTTP API: `/v1/models`, `/v1/completions`, `/v1/chat/completions`
(whole or streamed as server-sent events ending in `data: [DONE]`; generation_routes.py), vLLM's
`/tokenize` and `/detokenize` (tokenize_api.py), `/health` and `/live`.

Errors are OpenAI's error object with the status OpenAI uses: 400 for a bad body
(malformed JSON, a missing or out-of-range field, a prompt over the context), 404 for
an unknown model, 413 for a body over the limit, 429 when no decode worker has the
pages or the gateway holds `--max-num-requests` requests, 503 when no worker of a kind is
serving (both with `Retry-After`); with `--api-key`, 401 for a request
without one of the keys, but to the probes' and scrapers' paths (api_keys.py).

A stream's first chunk is awaited before the response starts (first_event_response.py),
so a request that fails before its first token still gets its real status, not a 200
with an error event. A client that goes away cancels its request wherever it is (prefill
or decode), which frees its pages: Starlette cancels a stream's body, and a whole
response waits until the client goes (http_responses.py).

Every request's ledger (timeline.py: where its time went, phase by phase) is kept for
the most recent requests and served from `GET /v1/requests/{id}/timeline`, `id` being
the response's `id`; a request with `"return_timeline": true` or the header
`X-Baton-Timeline: 1` also gets it in the response (`timeline`; when streaming, in one
last chunk with no choices, before `data: [DONE]`).

With tracing on (services/common/tracing.py), each HTTP request is a span, continuing the
caller's W3C `traceparent`; the pipeline's spans (request_trace.py) go beneath it.

`/metrics` serves the process's default registry (the router's figures) and the
gateway's own (`RequestPipeline.metrics`: per-request latencies, tokens, errors by
reason). The pipeline counts what happens to each request it is given; this layer
counts the requests refused before they reach it (a bad body, an unknown model, a
body over the limit).
"""
from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common import tracing
from services.gateway.anthropic_api import add_anthropic_routes
from services.gateway.anthropic_errors import in_its_apis_shape
from services.gateway.api_keys import ApiKeys, RequireApiKey
from services.gateway.background_responses import BackgroundResponses
from services.gateway.batch_api import BatchJobs, add_batch_routes
from services.gateway.cancel_api import add_cancel_routes
from services.gateway.chat_serving import ChatServing
from services.gateway.errors import APIError, api_error_response, to_api_error, validation_error
from services.gateway.generation_routes import add_generation_routes
from services.gateway.http_middleware import ArrivalTime, BodySizeLimit
from services.gateway.http_serving import HttpServing
from services.gateway.idle_sleep import IdleSleep, IdleSleepConfig
from services.gateway.lora_updates import LoRAUpdates
from services.gateway.openai_logprobs import TokenText
from services.gateway.operator_routes import add_operator_routes
from services.gateway.parser_routes import add_parser_routes
from services.gateway.pipeline import RequestPipeline
from services.gateway.pooling_routes import add_pooling_routes
from services.gateway.render_api import add_render_routes
from services.gateway.reply_options import ReplyOptions
from services.gateway.response_store import MemoryResponseStore, RedisResponseStore
from services.gateway.sagemaker_routes import add_sagemaker_routes
from services.gateway.served_models import ServedModels
from services.gateway.sglang_encode import add_sglang_encode_route
from services.gateway.stored_response_routes import add_stored_response_routes
from services.gateway.timeline import TimelineStore
from services.gateway.tokenize_api import add_tokenize_routes
from services.gateway.tokenizer_info import add_tokenizer_info_route
from services.gateway.tokens_api import add_tokens_routes
from services.gateway.vertex_routes import add_vertex_routes

if TYPE_CHECKING:  # imported by a gateway that serves them: it takes torch
    from services.gateway.image_inputs import ChatImages
    from services.gateway.prompt_embeds import PromptEmbedsReader

log = logging.getLogger("baton.gateway")

DEFAULT_MAX_BODY_BYTES = 8 * 2**20


@dataclass
class GatewayState:
    pipeline: RequestPipeline
    models: ServedModels  # what clients may name as the model: its names and LoRA adapters
    token_text: TokenText
    readiness: Callable[[], str | None]  # None when every kind of worker has one serving, else why not
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    timelines: TimelineStore = field(default_factory=TimelineStore)
    api_keys: ApiKeys | None = None  # None: no key asked for
    tool_call_parser: str | None = None  # None: tool_choice "auto" is refused
    reasoning_parser: str | None = None  # None: a chat reply's text is all content
    responses: MemoryResponseStore | RedisResponseStore | None = None  # None: no response is stored
    background: BackgroundResponses = field(default_factory=BackgroundResponses)
    batches: BatchJobs = field(default_factory=BatchJobs)  # OpenAI's Batch API, and the files it reads and writes
    serving: HttpServing = HttpServing()  # CORS (and TLS, which uvicorn serves)
    chat_serving: ChatServing = ChatServing()
    lora_updates: LoRAUpdates | None = None  # None: no adapter loaded or unloaded at run time
    tokenizer_info: dict[str, Any] | None = None  # GET /tokenizer_info's answer; None: not served
    prompt_embeds: PromptEmbedsReader | None = None  # what reads completions' prompt_embeds; None: refused
    images: ChatImages | None = None  # what reads a chat's images, for a model that takes them; None: refused
    replies: ReplyOptions = ReplyOptions()  # usage forced, timing, token ids (vLLM's flags)
    sleep_when_idle: IdleSleepConfig = IdleSleepConfig()  # vLLM's --sleep-idle-ttl (idle_sleep.py)
    idle_sleep: IdleSleep | None = None  # what puts the mesh to sleep when idle, made with the routes

    @property
    def model_name(self) -> str:
        """The name responses give (for a LoRA request, its adapter's)."""
        return self.models.name

    @property
    def max_model_len(self) -> int | None:
        return self.models.max_model_len


try:
    BATON_VERSION = importlib.metadata.version("baton")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
    BATON_VERSION = "unknown"

def create_app(state: GatewayState) -> FastAPI:
    app = FastAPI(title="Baton", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = state.pipeline.metrics
    app.add_middleware(BodySizeLimit, max_bytes=state.max_body_bytes,
                       on_refuse=lambda: metrics.count_error("request_too_large"))
    if state.api_keys is not None:  # outside the size limit: an unknown caller's body is not read
        app.add_middleware(RequireApiKey, keys=state.api_keys, on_refuse=lambda: metrics.count_error("unauthorized"))
    state.serving.add_cors(app)  # outside the key: a preflight has none, and a page may read a refusal
    if tracing.is_enabled():
        # The request's span, continuing an incoming `traceparent`; one span per request, not per
        # ASGI message, and none for the endpoints scraped and probed all day.
        from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
        app.add_middleware(OpenTelemetryMiddleware, excluded_urls="/metrics,/health,/live",
                           exclude_spans=["receive", "send"])
    app.add_middleware(ArrivalTime)  # outermost: the ledger's ingress starts before the body is read

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return api_error_response(in_its_apis_shape(request.scope, e))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:  # unknown path, wrong method
        error = in_its_apis_shape(request.scope, APIError(e.status_code, str(e.detail)))
        return api_error_response(error, headers=e.headers)  # a 405's Allow

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error")
        metrics.count_error("internal_error")
        return api_error_response(in_its_apis_shape(request.scope, to_api_error(e, "input")))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError) -> JSONResponse:
        metrics.count_error("invalid_request")
        return api_error_response(in_its_apis_shape(request.scope, validation_error(e)))

    # Ahead of the other routes: the router tries them in turn, and every request takes these.
    stored_response = add_stored_response_routes(app, state.responses, state.background)
    add_generation_routes(app, state, lambda model: check_model(state, model), stored_response)

    add_pooling_routes(app, state.pipeline, state.models, lambda model: check_model(state, model))
    add_sglang_encode_route(app, state, lambda model: check_model(state, model))
    add_tokens_routes(app, state, lambda model: check_model(state, model))
    add_batch_routes(app, state.batches, state.api_keys.any_key() if state.api_keys is not None else None)
    add_cancel_routes(app, state.pipeline.running)
    add_render_routes(app, state, lambda model: check_model(state, model))

    add_tokenize_routes(app, state, lambda model: check_model(state, model))
    if state.tokenizer_info is not None:
        add_tokenizer_info_route(app, state.tokenizer_info)
    add_parser_routes(app, state.tool_call_parser, state.reasoning_parser)
    add_anthropic_routes(app, state, lambda model: check_model(state, model))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:  # Prometheus text format, on the API port as vLLM serves it
        return Response(generate_latest(REGISTRY) + metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/live")
    async def live() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict[str, str]:  # vLLM's: which build answers
        return {"version": BATON_VERSION}

    @app.get("/health")
    async def health() -> JSONResponse:
        reason = state.readiness()
        if reason is not None:
            return api_error_response(APIError(503, reason, code="unavailable"))
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": state.models.cards()}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        return state.models.card(model)

    add_sagemaker_routes(app)
    add_vertex_routes(app)
    add_operator_routes(app, state, lambda model: check_model(state, model), BATON_VERSION)

    @app.get("/v1/requests/{response_id}/timeline")
    async def timeline(response_id: str) -> dict[str, Any]:
        found = state.timelines.get(response_id)
        if found is None:
            raise APIError(404, f"No timeline for request `{response_id}`: the gateway keeps the last "
                                f"{state.timelines.capacity} requests' timelines.", code="timeline_not_found")
        return found.to_json()

    return app


def check_model(state: GatewayState, model: str) -> str | None:
    """The LoRA adapter `model` names (None: the model itself); 404 for a name neither is."""
    try:
        return state.models.adapter_named(model)
    except APIError:
        state.pipeline.metrics.count_error("model_not_found")
        raise
