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
special tokens included. Both are the tokenizer service's work (Encode, ApplyChatTemplate,
Decode), so a long prompt is not encoded on the gateway's event loop; what it refuses
(a template that cannot render the messages, an id outside the vocabulary) is a 400.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from protos import tokenizer_pb2
from services.gateway.chat_messages import ChatMessage
from services.gateway.errors import APIError, to_api_error
from services.gateway.http_body import parsed_body
from services.gateway.openai_protocol import TokenId
from services.gateway.request_errors import UNTRUSTED_TEMPLATE
from services.gateway.tool_parsers import with_template_call_ids
from services.gateway.workers import NoHealthyWorkerError, WorkerPool
from services.tokenizer.chat_template import ChatOptions, check_template_kwargs
from services.tokenizer.converters import chat_template_request


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: vLLM's defaults, true for a prompt and false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # the request's own (--trust-request-chat-template only)
    tools: list[dict[str, Any]] | None = None  # shown to the model by templates that list them
    documents: list[dict[str, Any]] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        check_template_kwargs(self.chat_template_kwargs or {})
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: Annotated[list[TokenId], Field(min_length=1)]


async def tokenize(stub, body: TokenizeRequest, timeout_s: float, tool_call_parser: str | None = None,
                   trust_request_chat_template: bool = False) -> list[int]:
    """The prompt's token ids, by the tokenizer service behind `stub`; chat messages' tool-call ids
    as generation gives them to the template (`tool_call_parser`: the gateway's)."""
    if body.chat_template is not None and not trust_request_chat_template:
        raise APIError(400, UNTRUSTED_TEMPLATE, param="chat_template")
    try:
        if body.prompt is not None:
            return list(await _encode(stub, body.prompt, body.add_special_tokens is not False, timeout_s))
        messages = with_template_call_ids([m.as_template_input() for m in body.messages], tool_call_parser)
        options = ChatOptions(body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs or {},
                              body.tools or None, body.documents, body.chat_template, bool(body.add_special_tokens))
        return list((await stub.ApplyChatTemplate(chat_template_request("", messages, options),
                                                  timeout=timeout_s)).token_ids)
    except grpc.aio.AioRpcError as e:
        raise _refused(e, "prompt" if body.prompt is not None else "messages") from None


async def detokenize(stub, body: DetokenizeRequest, timeout_s: float) -> str:
    try:
        reply = await stub.Decode(tokenizer_pb2.DecodeRequest(token_ids=body.tokens, skip_special_tokens=False),
                                  timeout=timeout_s)
    except grpc.aio.AioRpcError as e:
        raise _refused(e, "tokens") from None
    return reply.text


async def _encode(stub, text: str, add_special_tokens: bool, timeout_s: float):
    reply = await stub.Encode(tokenizer_pb2.EncodeRequest(text=text, add_special_tokens=add_special_tokens),
                              timeout=timeout_s)
    return reply.token_ids


def tokenizer_service(tokenizers: WorkerPool, param: str):
    """The least loaded serving tokenizer service, held for the block; none serving is a 503."""
    try:
        return tokenizers.hold()
    except NoHealthyWorkerError as e:
        raise to_api_error(e, param) from None


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
        with tokenizer_service(pipeline.tokenizers, "prompt" if body.prompt is not None else "messages") as service:
            tokens = await tokenize(service.stub, body, pipeline.deadlines.tokenizer_s, state.tool_call_parser,
                                    pipeline.prompts.trust_request_chat_template)
        token_strs = [pipeline.tokenizer.id_to_token(t) for t in tokens] if body.return_token_strs else None
        return JSONResponse({"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens,
                             "token_strs": token_strs})

    async def detokenize_tokens(request: Request) -> JSONResponse:
        body = await parsed_body(request, DetokenizeRequest)
        if body.model is not None:
            check_model(body.model)
        with tokenizer_service(pipeline.tokenizers, "tokens") as service:
            return JSONResponse({"prompt": await detokenize(service.stub, body, pipeline.deadlines.tokenizer_s)})

    app.add_route("/tokenize", tokenize_prompt, methods=["POST"])
    app.add_route("/detokenize", detokenize_tokens, methods=["POST"])
