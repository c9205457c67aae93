"""vLLM's `POST /tokenize` and `POST /detokenize`: a prompt to the ids the model would be given
for it, and ids back to text, so a client can count tokens or budget a context without a
tokenizer of its own.

`/tokenize` takes a `prompt` (encoded with special tokens unless `add_special_tokens` is false)
or chat `messages` (rendered by the model's chat template as `/v1/chat/completions` renders them,
with the generation prompt unless `add_generation_prompt` is false, `continue_final_message` and
`chat_template_kwargs`, `chat_template`, `tools` and `documents` as chat takes them; special tokens
added to the rendered text only if `add_special_tokens` is true, as vLLM does) and answers
`{"count", "max_model_len", "tokens", "token_strs"}` (the vocabulary's strings of the ids with
`return_token_strs`, else null). `/detokenize` takes `tokens` and answers `{"prompt"}`,
special tokens included unless `skip_special_tokens`. SGLang serves the same paths, and `/v1/tokenize`
and `/v1/detokenize`, with a batch of prompts (a list: `tokens` and `count` are then lists) or of
token lists, its text named `text` (which the answer carries too), and special tokens skipped by
default on its `/v1` path. Both are the tokenizer service's work (Encode, ApplyChatTemplate,
Decode), so a long prompt is not encoded on the gateway's event loop; what it refuses
(a template that cannot render the messages, an id outside the vocabulary) is a 400. Where no
tokenizer service answers, the gateway does the same work itself, on a thread, as it encodes a
long prompt for generation then (prompt_encoder.py); not with a template of the request's own.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from protos import tokenizer_pb2
from services.gateway.chat_images import chat_image_sizes
from services.gateway.chat_messages import ChatMessage
from services.gateway.errors import APIError, FieldError, to_api_error
from services.gateway.http_body import parsed_body
from services.gateway.openai_protocol import TokenId
from services.gateway.prompt_encoder import PromptEncoder, as_the_service_reads
from services.gateway.request_errors import UNTRUSTED_TEMPLATE, InvalidRequestError
from services.gateway.tool_parsers import with_template_call_ids
from services.gateway.workers import NoHealthyWorkerError
from services.tokenizer.chat_template import ChatOptions, check_template_kwargs
from services.tokenizer.content_format import content_chars
from services.tokenizer.converters import chat_template_request
from services.tokenizer.image_tokens import ImageSize
from services.tokenizer.model_tokenizer import outside_vocabulary


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    prompt: str | list[str] | None = None  # a list: SGLang's batch, each prompt's ids apart
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: vLLM's defaults, true for a prompt and false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # the request's own (--trust-request-chat-template only)
    tools: list[dict[str, Any]] | None = None  # shown to the model by templates that list them
    documents: list[dict[str, Any]] | None = None
    return_token_strs: bool = False
    mm_processor_kwargs: dict[str, Any] | None = None  # the messages' images read by these, as chat's would be
    media_io_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        if isinstance(self.prompt, list) and not self.prompt:
            raise FieldError("prompt", "a list of prompts must not be empty")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        check_template_kwargs(self.chat_template_kwargs or {})
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: Annotated[list[TokenId] | list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    skip_special_tokens: bool | None = None  # None: the path's default, vLLM's (kept) or SGLang's (skipped)


async def tokenize(body: TokenizeRequest, prompts: PromptEncoder, tool_call_parser: str | None = None,
                   image_sizes: Sequence[ImageSize] = ()) -> list[int]:
    """The prompt's token ids, by the least loaded tokenizer service (here where none answers, as a long
    prompt's for generation: prompt_encoder.py), as `prompts` (the pipeline's) make generation's (its trust
    in requests' templates, its template defaults); chat messages' tool-call ids as generation gives them
    to the template (`tool_call_parser`: the gateway's), their images' tokens as many as their sizes
    (`image_sizes`, chat_images.py's) make."""
    if body.chat_template is not None and not prompts.trust_request_chat_template:
        raise APIError(400, UNTRUSTED_TEMPLATE, param="chat_template")
    param = "prompt" if body.prompt is not None else "messages"
    try:
        if body.prompt is not None:
            text, add_special_tokens = body.prompt, body.add_special_tokens is not False

            async def encode(stub) -> Sequence[int]:
                return (await stub.Encode(tokenizer_pb2.EncodeRequest(text=text, add_special_tokens=add_special_tokens),
                                          timeout=prompts.timeout_s)).token_ids

            return list(await prompts.by_service(len(text), encode,
                                                 lambda: prompts.tokenizer.encode(text, add_special_tokens)))
        messages = with_template_call_ids([m.as_template_input() for m in body.messages], tool_call_parser)
        options = prompts.chat_options(ChatOptions(
            body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs or {},
            body.tools or None, body.documents, body.chat_template, bool(body.add_special_tokens)))
        chat = as_the_service_reads(messages)

        async def render(stub) -> Sequence[int]:
            return (await stub.ApplyChatTemplate(chat_template_request("", messages, options, image_sizes),
                                                 timeout=prompts.timeout_s)).token_ids

        return list(await prompts.by_service(
            sum(content_chars(m["content"]) for m in chat), render,
            None if options.template is not None else lambda: prompts.rendered(chat, options, image_sizes)))
    except grpc.aio.AioRpcError as e:
        raise _refused(e, param) from None
    except (NoHealthyWorkerError, InvalidRequestError) as e:
        raise to_api_error(e, param) from None


async def detokenize(prompts: PromptEncoder, token_ids: list[int], skip_special_tokens: bool) -> str:
    """`token_ids`' text, by the least loaded tokenizer service, or here where none answers."""
    async def decode(stub) -> str:
        return (await stub.Decode(tokenizer_pb2.DecodeRequest(token_ids=token_ids,
                                                              skip_special_tokens=skip_special_tokens),
                                  timeout=prompts.timeout_s)).text

    def decode_here() -> str:
        outside = outside_vocabulary(token_ids, prompts.tokenizer.vocab_size)
        if outside is not None:
            raise APIError(400, outside, param="tokens")
        return prompts.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    try:
        return await prompts.by_service(len(token_ids), decode, decode_here)
    except grpc.aio.AioRpcError as e:
        raise _refused(e, "tokens") from None


def _refused(e: grpc.aio.AioRpcError, param: str) -> APIError:
    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return APIError(400, e.details(), param=param)
    return to_api_error(e, param)


def add_tokenize_routes(app: FastAPI, state, check_model: Callable[[str], str | None]) -> None:
    """`state`: the gateway's (http_app.GatewayState); `check_model`: a named model's LoRA adapter, or a 404."""
    pipeline = state.pipeline

    async def tokenize_prompt(request: Request) -> JSONResponse:
        body = await parsed_body(request, TokenizeRequest)
        if body.model is not None:
            check_model(body.model)

        sizes = await chat_image_sizes(state, body.messages or (), body.mm_processor_kwargs, body.media_io_kwargs)

        async def tokenized(one: TokenizeRequest) -> list[int]:
            return await tokenize(one, pipeline.prompts, state.tool_call_parser, sizes)

        def token_strs(tokens: list[int]) -> list[str]:
            return [pipeline.tokenizer.id_to_token(t) for t in tokens]

        if not isinstance(body.prompt, list):
            tokens = await tokenized(body)
            return JSONResponse({"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens,
                                 "token_strs": token_strs(tokens) if body.return_token_strs else None})
        batch = await asyncio.gather(*(tokenized(body.model_copy(update={"prompt": prompt}))
                                       for prompt in body.prompt))
        strs = [token_strs(tokens) for tokens in batch] if body.return_token_strs else None
        return JSONResponse({"count": [len(tokens) for tokens in batch], "max_model_len": state.max_model_len,
                             "tokens": batch, "token_strs": strs})

    def detokenize_tokens(skips_special_tokens: bool):
        async def endpoint(request: Request) -> JSONResponse:
            body = await parsed_body(request, DetokenizeRequest)
            if body.model is not None:
                check_model(body.model)
            skip = skips_special_tokens if body.skip_special_tokens is None else body.skip_special_tokens
            if isinstance(body.tokens[0], int):
                text = await detokenize(pipeline.prompts, body.tokens, skip)
            else:
                text = list(await asyncio.gather(*(detokenize(pipeline.prompts, ids, skip) for ids in body.tokens)))
            return JSONResponse({"prompt": text, "text": text})  # vLLM's name for it, and SGLang's
        return endpoint

    # vLLM's paths, which SGLang serves too; SGLang's own skip special tokens unless asked not to.
    for prefix, skips_special_tokens in (("", False), ("/v1", True)):
        app.add_route(f"{prefix}/tokenize", tokenize_prompt, methods=["POST"])
        app.add_route(f"{prefix}/detokenize", detokenize_tokens(skips_special_tokens), methods=["POST"])
