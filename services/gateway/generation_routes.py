"""The routes that generate text: `/v1/completions`, `/v1/chat/completions`, `POST /v1/responses` and
`POST /v1/messages` (the Responses API's and Anthropic's Messages API's requests, made chat requests and
answered in their own shapes), whole or streamed
(http_responses.py). Each request's choices are sent to the pipeline here: one per prompt and `n`,
or one beam search each, with the request's LoRA adapter, timeline and dispatch signal."""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from protos import common_pb2
from services.gateway.anthropic_api import MessagesShape
from services.gateway.anthropic_request import MessagesRequest
from services.gateway.beam_search import beam_choices, beam_search
from services.gateway.chat_images import chat_images
from services.gateway.chat_request import ChatCompletionRequest
from services.gateway.choices import choice_request_id, merge_choices
from services.gateway.completion_request import CompletionRequest, EmbeddedPrompt, pipeline_prompt
from services.gateway.deltas import Delta, prompt_only
from services.gateway.errors import APIError
from services.gateway.given_embeddings import GivenImages
from services.gateway.http_body import parsed_body
from services.gateway.http_middleware import ARRIVAL_KEY
from services.gateway.http_responses import respond
from services.gateway.openai_logprobs import TokenText
from services.gateway.openai_protocol import bad_words_encoded
from services.gateway.openai_responses import ResponseBuilder
from services.gateway.reasoning_parsers import ReasoningReader, reasoning_reader
from services.gateway.response_store import StoredResponse
from services.gateway.responses_api import ResponsesShape
from services.gateway.responses_request import ResponsesRequest, fit_to_context
from services.gateway.sequence_groups import counted_by_prompt
from services.gateway.timeline import ResponseTimeline
from services.gateway.tool_parsers import (
    call_ids,
    keeps_special_tokens,
    needs_a_parser,
    syntax_for,
    with_template_call_ids,
)

if TYPE_CHECKING:  # http_app imports this module to build its app
    from services.gateway.http_app import GatewayState


def add_generation_routes(app: FastAPI, state: GatewayState, check_model: Callable[[str], str | None],
                          stored_response: Callable[[str, str | None], Awaitable[StoredResponse]]) -> None:
    """`check_model(model)`: the LoRA adapter a request's `model` names (None: the model itself),
    APIError (404) for a name neither is; `stored_response(id, param)`: a stored response, or a 404
    naming `param` (what add_stored_response_routes returns), for a `previous_response_id`."""
    # The two routes every request takes: plain Starlette routes, ahead of the app's others. The router
    # tries routes in turn, and FastAPI's parameter handling has nothing to do for an endpoint that
    # takes the Request: together about 50 calls of Python on every request's way in, run cold
    # (the gateway idles between requests).
    def adapter_of(body: CompletionRequest | ChatCompletionRequest) -> str | None:
        """The LoRA adapter the request names: by `model`, or by SGLang's `lora_path` (not another)."""
        lora = check_model(body.model)
        if body.lora_path is None:
            return lora
        named = check_model(body.lora_path)
        if lora is not None and named != lora:
            raise APIError(400, f"model names the adapter {lora!r} and lora_path {named!r}", param="lora_path")
        return named

    async def completions(request: Request):
        body = await parsed_body(request, CompletionRequest)
        if body.max_tokens == 0 and not body.echo:  # (SGLang's /generate takes it alone: sglang_api.py)
            raise APIError(400, "max_tokens 0 gives the prompt alone, which needs echo", param="max_tokens")
        lora = adapter_of(body)
        state.models.check_generates()
        response_id = request.headers.get("x-request-id") or body.rid or f"cmpl-{uuid.uuid4().hex}"
        timeline = start_timeline(state, request, response_id)
        dispatched, on_dispatch = dispatch_signal()
        prompts = body.prompts
        bad_words = await bad_words_encoded(body.bad_words, state.pipeline.tokenizer)
        streams, searches, prompt_of_choice = [], [], []
        for p, prompt in enumerate(prompts):
            given = await _given_prompt(state, prompt, body.add_special_tokens)
            prompt_of_choice += [p] * body.num_candidates
            if body.use_beam_search:
                searches.append(beam_search(
                    state.pipeline, choice_request_id(response_id, p, len(prompts)), with_adapter(body.sampling(
                        body.max_tokens, body.logprobs, 0), lora), body.n, body.length_penalty, **given,
                    truncate_prompt_tokens=body.truncate_prompt_tokens, num_logprobs=body.logprobs,
                    include_stop_str_in_output=body.include_stop_str_in_output,
                    skip_special_tokens=body.skip_special_tokens, timeline=timeline, on_dispatch=on_dispatch))
                continue
            for j in range(body.num_candidates):
                request_id = choice_request_id(response_id, len(streams), len(prompts) * body.num_candidates)
                stream = state.pipeline.generate(
                    request_id, **given, sampling=with_adapter(body.sampling(
                        body.max_tokens_run, body.num_candidate_logprobs, j, bad_words,
                        state.pipeline.prompts.generation_defaults), lora),
                    stop=body.stops, include_stop_str_in_output=body.include_stop_str_in_output,
                    skip_special_tokens=body.skip_special_tokens, truncate_prompt_tokens=body.truncate_prompt_tokens,
                    clock=timeline.clock(request_id), on_dispatch=on_dispatch, is_streamed=body.stream)
                streams.append(prompt_only(stream) if body.max_tokens == 0 else stream)
        # Echoed as given; token ids as they decode (special tokens kept: they are part of the prompt).
        echo_of_prompt = [p if isinstance(p, str) else state.pipeline.tokenizer.decode(p, skip_special_tokens=False)
                          for p in prompts] if body.echo else None
        builder = ResponseBuilder(kind="completion", response_id=response_id, model=lora or state.model_name,
                                  num_choices=len(prompt_of_choice), prompt_of_choice=prompt_of_choice,
                                  token_text=_token_text(state, body), want_logprobs=body.logprobs is not None,
                                  num_logprobs=body.logprobs or 0, echo_of_prompt=echo_of_prompt,
                                  num_prompt_logprobs=body.prompt_logprobs,
                                  return_token_ids=bool(body.return_token_ids),
                                  best_of_kept=body.n if body.num_candidates > body.n else None,
                                  reply_options=state.replies)
        choices = counted_by_prompt(beam_choices(searches) if body.use_beam_search else merge_choices(streams),
                                    prompt_of_choice, state.pipeline.requests)
        return await respond(request, choices, builder, body.stream, state.replies.includes_usage(body.include_usage),
                             "prompt",
                             dispatched, timeline if wants_timeline(request, body.return_timeline) else None,
                             continuous_usage=body.continuous_usage)

    async def start_chat(request: Request, body: ChatCompletionRequest, response_id: str,
                   images: GivenImages | None = None,
                   ) -> tuple[AsyncIterator[tuple[int, Delta]], ResponseBuilder, asyncio.Future, ResponseTimeline]:
        """A chat request's choices on their way, and what builds their output; `images`: its messages'
        pixels (read by `chat_images`)."""
        lora = adapter_of(body)
        state.models.check_generates()
        if body.lets_the_model_call_tools and state.tool_call_parser is None:
            raise needs_a_parser("tool_choice")
        timeline = start_timeline(state, request, response_id)
        dispatched, on_dispatch = dispatch_signal()
        messages = with_template_call_ids(body.chat_messages(), state.tool_call_parser)
        request_ids = [choice_request_id(response_id, j, body.n) for j in range(body.n)]
        reasoning = _reasoning_reader(state, body)
        bad_words = await bad_words_encoded(body.bad_words, state.pipeline.tokenizer)
        syntax = syntax_for(state.tool_call_parser, body.tools) if body.lets_the_model_call_tools else None
        split = reasoning if body.separate_reasoning else None  # what reads the thinking out of the text
        skip_special_tokens = body.skip_special_tokens and not keeps_special_tokens(syntax, split)
        if body.use_beam_search and images:
            raise APIError(400, "beam search takes text messages, not images", param="use_beam_search")
        if body.use_beam_search:
            choices = beam_choices([beam_search(
                state.pipeline, response_id, with_adapter(body.sampling(body.completion_budget, body.num_logprobs, 0),
                                                           lora), body.n, body.length_penalty,
                messages=messages, chat_options=body.chat_options(), truncate_prompt_tokens=body.truncate_prompt_tokens,
                num_logprobs=body.num_logprobs, include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=skip_special_tokens, timeline=timeline, on_dispatch=on_dispatch)])
        else:
            choices = merge_choices([state.pipeline.generate(
                request_id, messages=messages, chat_options=body.chat_options(), images=images,
                sampling=with_adapter(body.sampling(body.completion_budget, body.num_logprobs, j, bad_words,
                                                     state.pipeline.prompts.generation_defaults), lora),
                stop=body.stops, include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=skip_special_tokens, truncate_prompt_tokens=body.truncate_prompt_tokens,
                clock=timeline.clock(request_id), on_dispatch=on_dispatch,
                guide_after=reasoning.guide_after if reasoning is not None else None, is_streamed=body.stream)
                for j, request_id in enumerate(request_ids)])
        choices = counted_by_prompt(choices, [0] * body.n, state.pipeline.requests)
        builder = ResponseBuilder(kind="chat", response_id=response_id, model=lora or state.model_name,
                                  num_choices=body.n,
                                  prompt_of_choice=[0] * body.n, token_text=_token_text(state, body),
                                  want_logprobs=body.logprobs, num_prompt_logprobs=body.prompt_logprobs,
                                  forced_tool_call=body.forced_tool_call, tool_call_syntax=syntax,
                                  call_id=call_ids(state.tool_call_parser), reasoning=split,
                                  include_reasoning=body.include_reasoning, echo_of_prompt=body.echoed,
                                  parallel_tool_calls=body.parallel_tool_calls,
                                  return_token_ids=bool(body.return_token_ids),
                                  role=state.chat_serving.role_of_reply(body),
                                  reply_options=state.replies)
        return choices, builder, dispatched, timeline

    async def chat_completions(request: Request):
        body = state.chat_serving.as_served(await parsed_body(request, ChatCompletionRequest))
        response_id = request.headers.get("x-request-id") or body.rid or f"chatcmpl-{uuid.uuid4().hex}"
        images = await chat_images(state, body.messages, processor_kwargs=body.mm_processor_kwargs,
                                   media_io_kwargs=body.media_io_kwargs)
        choices, builder, dispatched, timeline = await start_chat(request, body, response_id, images)
        return await respond(request, choices, builder, body.stream, state.replies.includes_usage(body.include_usage),
                             "messages",
                             dispatched, timeline if wants_timeline(request, body.return_timeline) else None,
                             continuous_usage=body.continuous_usage)


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
        body = state.chat_serving.as_served(asked.as_chat(earlier))
        images = await chat_images(state, body.messages, "input")
        if asked.truncation == "auto":  # off the event loop: a conversation long enough to cut renders slowly
            body, images = await asyncio.to_thread(fit_to_context, body, state.pipeline.prompts, images)
        response_id = request.headers.get("x-request-id") or f"resp_{uuid.uuid4().hex}"
        choices, builder, dispatched, _ = await start_chat(request, body, response_id, images)
        shape = ResponsesShape(asked, builder, state.responses, [*earlier, *asked.stored_items()])
        if asked.background:
            return JSONResponse(await state.background.start(shape, choices), headers={"x-request-id": response_id})
        return await respond(request, choices, builder, asked.stream, False, "input", dispatched, shape=shape)

    async def messages(request: Request):  # (its errors in Anthropic's shape: anthropic_errors.in_its_apis_shape)
        asked = await parsed_body(request, MessagesRequest)
        if asked.max_tokens is None:
            raise APIError(400, "max_tokens: Field required", param="max_tokens")
        response_id = request.headers.get("x-request-id") or f"msg_{uuid.uuid4().hex}"
        chat = asked.as_chat(keeps_thinking_budgets=state.pipeline.checks.thinking_markers is not None)
        choices, builder, dispatched, _ = await start_chat(request, state.chat_serving.as_served(chat), response_id,
                                                     await chat_images(state, chat.messages))
        return await respond(request, choices, builder, asked.stream, False, "messages", dispatched,
                             shape=MessagesShape(builder))

    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_route("/v1/responses", responses, methods=["POST"])
    app.add_route("/v1/messages", messages, methods=["POST"])


def with_adapter(sampling: common_pb2.SamplingParams, lora: str | None) -> common_pb2.SamplingParams:
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


def dispatch_signal() -> tuple[asyncio.Future, Callable[[], None]]:
    """A future, and the pipeline's `on_dispatch` that makes it done (for the first choice sent)."""
    dispatched = asyncio.get_running_loop().create_future()
    return dispatched, lambda: dispatched.done() or dispatched.set_result(None)


async def _given_prompt(state: GatewayState, prompt: str | list[int] | EmbeddedPrompt,
                        add_special_tokens: bool) -> dict[str, Any]:
    """A completion's prompt as the pipeline takes it; APIError (400) for embeddings this gateway does
    not take, or cannot read (read on a thread: torch.load of megabytes takes milliseconds)."""
    if not isinstance(prompt, EmbeddedPrompt):
        return pipeline_prompt(prompt, add_special_tokens)
    if state.prompt_embeds is None:
        raise APIError(400, "prompt_embeds are taken only by a server started with --enable-prompt-embeds "
                            "(as vLLM's)", param="prompt_embeds")
    return {"prompt_embeds": await asyncio.to_thread(state.prompt_embeds.read, prompt.encoded)}


def _token_text(state: GatewayState, body: CompletionRequest | ChatCompletionRequest) -> TokenText:
    """How logprobs name a token: by its text, or "token_id:N" (vLLM's `return_tokens_as_token_ids`, by
    default the gateway's flag)."""
    by_id = body.return_tokens_as_token_ids
    return token_id_text if (state.replies.return_tokens_as_token_ids if by_id is None else by_id) else state.token_text


def token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"
