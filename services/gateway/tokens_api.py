"""vLLM's tokens-in, tokens-out API, `POST /inference/v1/generate`: for clients that render and
tokenize themselves (RL frameworks' rollouts, routers such as llm-d's) and read token ids back.

In: `token_ids`, `sampling_params` (vLLM's SamplingParams by its names: those the completions API
takes, SAMPLING_FIELDS; others are ignored, as the other APIs ignore what they do not know), `model`
(absent: the model itself), `stream` with `stream_options`, `cache_salt`, `priority`, `request_id`
(the `x-request-id` header wins). `kv_transfer_params` is taken and ignored: the mesh hands its KV
from prefill to decode itself, so no connector's parameters come back (null). Multimodal
`features` are refused. Without `max_tokens`, a reply may use what the context leaves, as vLLM's.
Out: `request_id`, `choices` (`index`, `token_ids`, `finish_reason`, `logprobs` as chat's, each
token named `token_id:N`), `usage`, `prompt_logprobs`, `kv_transfer_params`; streamed, a chunk per
delta of `request_id` and `choices`, the usage after them with `stream_options.include_usage`, then
`data: [DONE]`. vLLM's cancel API (cancel_api.py: `POST /abort_requests`, ...) ends running ones by
the ids the API answered with.
"""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from services.gateway.choices import choice_request_id, first_choice, merge_choices
from services.gateway.completion_request import CompletionRequest
from services.gateway.deltas import Delta
from services.gateway.errors import APIError, to_api_error
from services.gateway.generation_routes import dispatch_signal, start_timeline, token_id_text, with_adapter
from services.gateway.http_body import parsed_body
from services.gateway.http_responses import respond, sse_event
from services.gateway.openai_protocol import TokenId, bad_words_encoded, header_safe
from services.gateway.openai_responses import ResponseBuilder
from services.gateway.reasoning_parsers import reasoning_reader
from services.gateway.sequence_groups import counted_by_prompt

if TYPE_CHECKING:
    from services.gateway.http_app import GatewayState

# vLLM's SamplingParams fields the completions API takes by the same names and meanings.
SAMPLING_FIELDS = frozenset({
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k", "min_p",
    "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
    "skip_special_tokens", "include_stop_str_in_output", "logit_bias", "allowed_token_ids", "bad_words",
    "structured_outputs", "thinking_token_budget", "truncate_prompt_tokens", "logits_processors"})
ID_PREFIX = "generate-tokens-"  # vLLM's, before the client's id or a random one


class TokensRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    token_ids: Annotated[list[TokenId], Field(min_length=1)]
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    model: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    cache_salt: str | None = None
    priority: int = 0
    request_id: Annotated[str, Field(min_length=1), AfterValidator(header_safe)] | None = None
    features: Any = None
    kv_transfer_params: dict[str, Any] | None = None

    def as_completion(self, model_name: str) -> CompletionRequest:
        """The completions request this one asks for; a 400 naming the field it got wrong. Without
        max_tokens its max_tokens is None: the pipeline fills in what the context leaves."""
        if self.features is not None:
            raise APIError(400, "multimodal features are not supported here: the models served read text",
                           param="features")
        sampling = {name: value for name, value in self.sampling_params.items() if name in SAMPLING_FIELDS}
        if sampling.get("max_tokens") == 0:  # the completions API's prompt alone, which this API has no echo for
            raise APIError(400, "max_tokens must be at least 1", param="sampling_params.max_tokens")
        given = {**sampling, "model": self.model or model_name, "prompt": self.token_ids, "stream": self.stream,
                 "stream_options": self.stream_options, "cache_salt": self.cache_salt, "priority": self.priority}
        try:
            completion = CompletionRequest.model_validate(given)
        except ValidationError as e:  # named where the client wrote it
            raise RequestValidationError([_located(error, sampling) for error in e.errors(include_url=False)]
                                         ) from None
        if sampling.get("max_tokens") is None:
            completion.max_tokens = None
        return completion


def _located(error: dict[str, Any], sampling: dict[str, Any]) -> dict[str, Any]:
    loc = tuple(error.get("loc", ()))
    if loc and loc[0] in sampling:
        loc = ("sampling_params", *loc)
    elif loc and loc[0] == "prompt":
        loc = ("token_ids", *loc[1:])
    return {**error, "loc": loc}


class TokensShape:
    """A response in the tokens API's shape, from chat's output for its choices (`builder`)."""

    def __init__(self, builder: ResponseBuilder, include_usage: bool):
        self.builder = builder
        self.include_usage = include_usage

    async def keep(self, response: dict[str, Any]) -> None:
        """(Nothing is stored.)"""

    def whole(self, chat: dict[str, Any]) -> dict[str, Any]:
        return {"request_id": self.builder.id, "choices": [_choice(choice) for choice in chat["choices"]],
                "usage": chat["usage"], "prompt_logprobs": chat.get("prompt_logprobs"), "kv_transfer_params": None}

    async def events(self, choices: AsyncIterator[tuple[int, Delta]], prompt_param: str) -> AsyncIterator[bytes]:
        """APIError before the first event (the response's status then), an error event after it."""
        try:
            first = await first_choice(choices, prompt_param)
            try:
                yield self._event(*first)
                async for index, delta in choices:
                    yield self._event(index, delta)
                if self.include_usage:
                    yield sse_event({"request_id": self.builder.id, "choices": [], "usage": self.builder.usage})
            except Exception as e:  # after the 200 went out: the error travels as an event
                yield sse_event(to_api_error(e, prompt_param).body())
        finally:
            await choices.aclose()
        yield b"data: [DONE]\n\n"

    def _event(self, index: int, delta: Delta) -> bytes:
        chunk = self.builder.chunk(index, delta, include_usage=False)
        return sse_event({"request_id": self.builder.id, "choices": [_choice(chunk["choices"][0])]})


def _choice(chat_choice: dict[str, Any]) -> dict[str, Any]:
    return {"index": chat_choice["index"], "token_ids": list(chat_choice["token_ids"]),
            "finish_reason": chat_choice["finish_reason"], "logprobs": chat_choice["logprobs"]}


def add_tokens_routes(app: FastAPI, state: GatewayState, check_model: Callable[[str], str | None]) -> None:
    """`check_model(model)`: the LoRA adapter `model` names (None: the model itself), or a 404."""

    async def generate_tokens(request: Request):
        asked = await parsed_body(request, TokensRequest)
        body = asked.as_completion(state.model_name)
        lora = check_model(body.model)
        state.models.check_generates()
        response_id = ID_PREFIX + (request.headers.get("x-request-id") or asked.request_id or uuid.uuid4().hex)
        timeline = start_timeline(state, request, response_id)
        dispatched, on_dispatch = dispatch_signal()
        bad_words = await bad_words_encoded(body.bad_words, state.pipeline.tokenizer)
        # A guided reply of a reasoning model is guided after its thinking, as chat's is.
        reasoning = reasoning_reader(state.reasoning_parser, state.pipeline.tokenizer, body.is_guided)
        request_ids = [choice_request_id(response_id, j, body.n) for j in range(body.n)]
        choices = merge_choices([state.pipeline.generate(
            request_id, prompt_token_ids=asked.token_ids, sampling=with_adapter(body.sampling(
                body.max_tokens, body.logprobs, j, bad_words, state.pipeline.prompts.generation_defaults), lora),
            stop=body.stops, include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens, truncate_prompt_tokens=body.truncate_prompt_tokens,
            clock=timeline.clock(request_id), on_dispatch=on_dispatch, is_streamed=body.stream,
            guide_after=reasoning.guide_after if reasoning is not None else None)
            for j, request_id in enumerate(request_ids)])
        choices = counted_by_prompt(choices, [0] * body.n, state.pipeline.requests)
        builder = ResponseBuilder(kind="chat", response_id=response_id, model=lora or state.model_name,
                                  num_choices=body.n, prompt_of_choice=[0] * body.n, token_text=token_id_text,
                                  want_logprobs=body.logprobs is not None, num_prompt_logprobs=body.prompt_logprobs,
                                  return_token_ids=True)
        return await respond(request, choices, builder, body.stream, False, "token_ids", dispatched,
                             shape=TokensShape(builder, body.include_usage))

    app.add_route("/inference/v1/generate", generate_tokens, methods=["POST"])
