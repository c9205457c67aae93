"""The OpenAI-compatible HTTP API: `/v1/models`, `/v1/completions`, `/v1/chat/completions`
(whole or streamed as server-sent events ending in `data: [DONE]`), vLLM's `/tokenize` and
`/detokenize` (tokenize_api.py), `/health` and `/live`.

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

import asyncio
import importlib.metadata
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from protos import common_pb2
from services.common import tracing
from services.gateway.api_keys import ApiKeys, RequireApiKey
from services.gateway.background_responses import BackgroundResponses
from services.gateway.beam_search import beam_choices, beam_search
from services.gateway.chat_request import ChatCompletionRequest
from services.gateway.choices import choice_request_id, merge_choices
from services.gateway.deltas import Delta
from services.gateway.errors import APIError, api_error_response, to_api_error, validation_error
from services.gateway.http_body import parsed_body
from services.gateway.http_middleware import ARRIVAL_KEY, ArrivalTime, BodySizeLimit
from services.gateway.http_responses import respond
from services.gateway.http_serving import HttpServing
from services.gateway.lora_updates import LoRAUpdates
from services.gateway.openai_logprobs import TokenText
from services.gateway.openai_protocol import CompletionRequest, encoded_bad_words
from services.gateway.openai_responses import ResponseBuilder
from services.gateway.operator_routes import add_operator_routes
from services.gateway.pipeline import RequestPipeline
from services.gateway.pooling_routes import add_pooling_routes
from services.gateway.reasoning_parsers import ReasoningReader, reasoning_reader
from services.gateway.response_store import MemoryResponseStore, RedisResponseStore
from services.gateway.responses_api import ResponsesShape
from services.gateway.responses_request import ResponsesRequest, fit_to_context
from services.gateway.sagemaker_routes import add_sagemaker_routes
from services.gateway.served_models import ServedModels
from services.gateway.stored_response_routes import add_stored_response_routes
from services.gateway.timeline import ResponseTimeline, TimelineStore
from services.gateway.tokenize_api import add_tokenize_routes
from services.gateway.tool_parsers import (
    call_ids,
    keeps_special_tokens,
    needs_a_parser,
    syntax_for,
    with_template_call_ids,
)

T = TypeVar("T")
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
    serving: HttpServing = HttpServing()  # CORS (and TLS, which uvicorn serves)
    lora_updates: LoRAUpdates | None = None  # None: no adapter loaded or unloaded at run time

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
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return api_error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:  # unknown path, wrong method
        return api_error_response(APIError(e.status_code, str(e.detail)), headers=e.headers)  # a 405's Allow

    @app.exception_handler(Exception)
    async def unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error")
        metrics.count_error("internal_error")
        return api_error_response(to_api_error(e, "input"))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, e: RequestValidationError) -> JSONResponse:
        metrics.count_error("invalid_request")
        return api_error_response(validation_error(e))

    # The two routes every request takes: plain Starlette routes, first in the table. The router
    # tries routes in turn, and FastAPI's parameter handling has nothing to do for an endpoint that
    # takes the Request: together about 50 calls of Python on every request's way in, run cold
    # (the gateway idles between requests).
    async def completions(request: Request):
        body = await parsed_body(request, CompletionRequest)
        lora = check_model(state, body.model)
        state.models.check_generates()
        response_id = request.headers.get("x-request-id") or f"cmpl-{uuid.uuid4().hex}"
        timeline = start_timeline(state, request, response_id)
        dispatched, on_dispatch = _dispatch_signal()
        prompts = body.prompts
        bad_words = encoded_bad_words(body.bad_words, state.pipeline.tokenizer)
        streams, searches, prompt_of_choice = [], [], []
        for p, prompt in enumerate(prompts):
            given = ({"prompt_text": prompt, "add_special_tokens": body.add_special_tokens}
                     if isinstance(prompt, str) else {"prompt_token_ids": prompt})
            prompt_of_choice += [p] * body.n
            if body.use_beam_search:
                searches.append(beam_search(
                    state.pipeline, choice_request_id(response_id, p, len(prompts)), _with_adapter(body.sampling(
                        body.max_tokens, body.logprobs, 0), lora), body.n, body.length_penalty, **given,
                    truncate_prompt_tokens=body.truncate_prompt_tokens, num_logprobs=body.logprobs,
                    include_stop_str_in_output=body.include_stop_str_in_output,
                    skip_special_tokens=body.skip_special_tokens, timeline=timeline, on_dispatch=on_dispatch))
                continue
            for j in range(body.n):
                request_id = choice_request_id(response_id, len(streams), len(prompts) * body.n)
                streams.append(state.pipeline.generate(
                    request_id, **given, sampling=_with_adapter(body.sampling(
                        body.max_tokens, body.logprobs, j, bad_words, state.pipeline.prompts.generation_defaults),
                        lora),
                    stop=body.stop_strings, include_stop_str_in_output=body.include_stop_str_in_output,
                    skip_special_tokens=body.skip_special_tokens, truncate_prompt_tokens=body.truncate_prompt_tokens,
                    clock=timeline.clock(request_id), on_dispatch=on_dispatch, is_streamed=body.stream))
        # Echoed as given; token ids as they decode (special tokens kept: they are part of the prompt).
        echo_of_prompt = [p if isinstance(p, str) else state.pipeline.tokenizer.decode(p, skip_special_tokens=False)
                          for p in prompts] if body.echo else None
        builder = ResponseBuilder(kind="completion", response_id=response_id, model=lora or state.model_name,
                                  num_choices=len(prompt_of_choice), prompt_of_choice=prompt_of_choice,
                                  token_text=_token_text(state, body), want_logprobs=body.logprobs is not None,
                                  num_logprobs=body.logprobs or 0, echo_of_prompt=echo_of_prompt,
                                  num_prompt_logprobs=body.prompt_logprobs)
        choices = beam_choices(searches) if body.use_beam_search else merge_choices(streams)
        return await respond(request, choices, builder, body.stream, body.include_usage, "prompt",
                             dispatched, timeline if wants_timeline(request, body.return_timeline) else None,
                             continuous_usage=body.continuous_usage)

    def start_chat(request: Request, body: ChatCompletionRequest, response_id: str
                   ) -> tuple[AsyncIterator[tuple[int, Delta]], ResponseBuilder, asyncio.Future, ResponseTimeline]:
        """A chat request's choices on their way, and what builds their output."""
        lora = check_model(state, body.model)
        state.models.check_generates()
        if body.lets_the_model_call_tools and state.tool_call_parser is None:
            raise needs_a_parser("tool_choice")
        timeline = start_timeline(state, request, response_id)
        dispatched, on_dispatch = _dispatch_signal()
        messages = with_template_call_ids(body.chat_messages(), state.tool_call_parser)
        request_ids = [choice_request_id(response_id, j, body.n) for j in range(body.n)]
        reasoning = _reasoning_reader(state, body)
        bad_words = encoded_bad_words(body.bad_words, state.pipeline.tokenizer)
        syntax = syntax_for(state.tool_call_parser, body.tools) if body.lets_the_model_call_tools else None
        skip_special_tokens = body.skip_special_tokens and not keeps_special_tokens(syntax, reasoning)
        if body.use_beam_search:
            choices = beam_choices([beam_search(
                state.pipeline, response_id, _with_adapter(body.sampling(body.completion_budget, body.num_logprobs, 0),
                                                           lora), body.n, body.length_penalty,
                messages=messages, chat_options=body.chat_options(), truncate_prompt_tokens=body.truncate_prompt_tokens,
                num_logprobs=body.num_logprobs, include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=skip_special_tokens, timeline=timeline, on_dispatch=on_dispatch)])
        else:
            choices = merge_choices([state.pipeline.generate(
                request_id, messages=messages, chat_options=body.chat_options(),
                sampling=_with_adapter(body.sampling(body.completion_budget, body.num_logprobs, j, bad_words,
                                                     state.pipeline.prompts.generation_defaults), lora),
                stop=body.stop_strings, include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=skip_special_tokens, truncate_prompt_tokens=body.truncate_prompt_tokens,
                clock=timeline.clock(request_id), on_dispatch=on_dispatch,
                guide_after=reasoning.guide_after if reasoning is not None else None, is_streamed=body.stream)
                for j, request_id in enumerate(request_ids)])
        builder = ResponseBuilder(kind="chat", response_id=response_id, model=lora or state.model_name,
                                  num_choices=body.n,
                                  prompt_of_choice=[0] * body.n, token_text=_token_text(state, body),
                                  want_logprobs=body.logprobs, num_prompt_logprobs=body.prompt_logprobs,
                                  forced_tool_call=body.forced_tool_call, tool_call_syntax=syntax,
                                  call_id=call_ids(state.tool_call_parser), reasoning=reasoning,
                                  include_reasoning=body.include_reasoning, echo_of_prompt=body.echoed,
                                  parallel_tool_calls=body.parallel_tool_calls)
        return choices, builder, dispatched, timeline

    async def chat_completions(request: Request):
        body = await parsed_body(request, ChatCompletionRequest)
        response_id = request.headers.get("x-request-id") or f"chatcmpl-{uuid.uuid4().hex}"
        choices, builder, dispatched, timeline = start_chat(request, body, response_id)
        return await respond(request, choices, builder, body.stream, body.include_usage, "messages",
                             dispatched, timeline if wants_timeline(request, body.return_timeline) else None,
                             continuous_usage=body.continuous_usage)

    stored_response = add_stored_response_routes(app, state.responses, state.background)

    async def responses(request: Request):
        asked = await parsed_body(request, ResponsesRequest)
        if asked.background and asked.stream:
            raise APIError(400, "a background response is not streamed here: read it with GET /v1/responses/{id}",
                           param="stream")
        if asked.background and (not asked.store or state.responses is None):
            raise APIError(400, "a background response is read from the response store: it needs store true "
                                "(and a gateway that stores responses, --responses-ttl-s > 0)", param="background")
        earlier = []  # the conversation the response continues
        if asked.previous_response_id is not None:
            previous = await stored_response(asked.previous_response_id, "previous_response_id")
            earlier = previous.continued()
        body = asked.as_chat(earlier)
        if asked.truncation == "auto":  # off the event loop: a conversation long enough to cut renders slowly
            body = await asyncio.to_thread(fit_to_context, body, state.pipeline.tokenizer)
        response_id = request.headers.get("x-request-id") or f"resp_{uuid.uuid4().hex}"
        choices, builder, dispatched, _ = start_chat(request, body, response_id)
        shape = ResponsesShape(asked, builder, state.responses, [*earlier, *asked.stored_items()])
        if asked.background:
            return JSONResponse(await state.background.start(shape, choices), headers={"x-request-id": response_id})
        return await respond(request, choices, builder, asked.stream, False, "input", dispatched, shape=shape)

    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_route("/v1/responses", responses, methods=["POST"])

    add_pooling_routes(app, state.pipeline, state.models, lambda model: check_model(state, model))

    add_tokenize_routes(app, state, lambda model: check_model(state, model))

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


def _with_adapter(sampling: common_pb2.SamplingParams, lora: str | None) -> common_pb2.SamplingParams:
    if lora is not None:
        sampling.lora_name = lora
    return sampling


def start_timeline(state: GatewayState, request: Request, response_id: str) -> ResponseTimeline:
    """The request's ledger, from its arrival (stamped by `ArrivalTime`), kept for the timeline endpoint."""
    arrival = request.scope.get("state", {}).get(ARRIVAL_KEY, time.perf_counter())
    timeline = ResponseTimeline(response_id, arrival, int(time.time()))
    state.timelines.add(timeline)
    return timeline


def wants_timeline(request: Request, asked_in_body: bool) -> bool:
    return asked_in_body or request.headers.get("x-baton-timeline", "").lower() in ("1", "true", "yes")


def _reasoning_reader(state: GatewayState, body: ChatCompletionRequest) -> ReasoningReader | None:
    """None without a parser, and for a forced tool call: its text is the call's."""
    if body.forced_tool_call is not None:
        return None
    return reasoning_reader(state.reasoning_parser, state.pipeline.tokenizer, body.is_guided)


def _dispatch_signal() -> tuple[asyncio.Future, Callable[[], None]]:
    """A future, and the pipeline's `on_dispatch` that makes it done (for the first choice sent)."""
    dispatched = asyncio.get_running_loop().create_future()
    return dispatched, lambda: dispatched.done() or dispatched.set_result(None)


def _token_text(state: GatewayState, body: CompletionRequest | ChatCompletionRequest) -> TokenText:
    """How logprobs name a token: by its text, or "token_id:N" (vLLM's `return_tokens_as_token_ids`)."""
    return _token_id_text if body.return_tokens_as_token_ids else state.token_text


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


