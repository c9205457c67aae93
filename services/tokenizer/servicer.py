"""The Tokenizer gRPC service (protos/tokenizer.proto) over one model's `ModelTokenizer`.

Bad input is refused with INVALID_ARGUMENT and a message safe to show the client;
calls that arrive while the tokenizer is still loading get UNAVAILABLE. Tokenizing
a long text takes milliseconds of CPU, so long inputs are encoded in a worker
thread (HF `tokenizers` releases the GIL) and never stall the event loop for the
short requests behind them; short ones run inline, where a thread hop would cost
more than the work. Each refusal is counted as an error, by its code's name.
"""
from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import TypeVar

import grpc

from protos import tokenizer_pb2, tokenizer_pb2_grpc
from services.common.metrics import ServiceMetrics
from services.tokenizer.chat_template import (
    check_messages,
    documents_from_json,
    template_kwargs_from_json,
    tools_from_json,
)
from services.tokenizer.content_format import content_chars
from services.tokenizer.converters import chat_messages_from_proto
from services.tokenizer.image_tokens import ImageSize
from services.tokenizer.model_tokenizer import ContextLengthError, ModelTokenizer, outside_vocabulary

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name
# Inputs longer than this (characters, or token ids to decode) go to a worker thread.
INLINE_LIMIT = 2048

T = TypeVar("T")


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    """Every RPC of baton.tokenizer.v1.Tokenizer. `tokenizer` may be set after the
    server starts (`__main__` loads it while health reports NOT_SERVING)."""

    def __init__(self, tokenizer: ModelTokenizer | None = None, metrics: ServiceMetrics | None = None):
        self.tokenizer = tokenizer
        self.metrics = metrics or ServiceMetrics("tokenizer")

    async def Encode(self, request, context):
        tokenizer = await self._ready(context)
        ids = await _run(len(request.text) > INLINE_LIMIT, tokenizer.encode, request.text,
                         request.add_special_tokens)
        return tokenizer_pb2.EncodeResponse(token_ids=ids)

    async def ApplyChatTemplate(self, request, context):
        tokenizer = await self._ready(context)
        try:
            messages = chat_messages_from_proto(request.messages)
            check_messages(messages)
            kwargs = template_kwargs_from_json(request.chat_template_kwargs_json)
            tools = tools_from_json(request.tools_json)
            documents = documents_from_json(request.documents_json)
            num_chars = sum(content_chars(m["content"]) for m in messages)
            # Rendering is Jinja (Python, holds the GIL) but encoding the result is not. A request's own
            # template always renders on a thread: nothing bounds what it does.
            text, ids = await _run(num_chars > INLINE_LIMIT or bool(request.chat_template), functools.partial(
                tokenizer.apply_chat_template, tools=tools, continue_final_message=request.continue_final_message,
                documents=documents, chat_template=request.chat_template or None,
                add_special_tokens=request.add_special_tokens, content_format=request.content_format or "auto",
                image_sizes=[ImageSize(size.height, size.width, size.num_crops, size.frames, tuple(size.frame_times),
                                      size.columns)
                             for size in request.image_sizes],
                **kwargs), messages, request.add_generation_prompt)
        except ValueError as e:  # ChatTemplateError among them: a template's refusal
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return tokenizer_pb2.ApplyChatTemplateResponse(token_ids=ids, text=text)

    async def Decode(self, request, context):
        tokenizer = await self._ready(context)
        outside = outside_vocabulary(request.token_ids, tokenizer.vocab_size)
        if outside is not None:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, outside)
        text = await _run(len(request.token_ids) > INLINE_LIMIT, tokenizer.decode, request.token_ids,
                          request.skip_special_tokens)
        return tokenizer_pb2.DecodeResponse(text=text)

    async def CheckContext(self, request, context):
        """fits=false (with the message to show) when the prompt plus the budget exceeds
        the context; INVALID_ARGUMENT only for a request that is malformed in itself.
        With no known context length (max_model_len 0) everything fits, and a request
        without max_tokens gets max_tokens 0 (unbounded)."""
        tokenizer = await self._ready(context)
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty (num_prompt_tokens is 0)")
        has_budget = request.HasField("max_tokens")
        if has_budget and request.max_tokens == 0:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be at least 1")
        limit = tokenizer.max_model_len
        try:
            budget = tokenizer.completion_budget(num_prompt, request.max_tokens if has_budget else None)
        except ContextLengthError as e:
            return tokenizer_pb2.CheckContextResponse(fits=False, max_model_len=limit or 0,
                                                      max_tokens=request.max_tokens, message=str(e))
        return tokenizer_pb2.CheckContextResponse(fits=True, max_model_len=limit or 0, max_tokens=budget or 0)

    async def _ready(self, context) -> ModelTokenizer:
        if self.tokenizer is None:
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, "the tokenizer is still loading")
        return self.tokenizer

    async def _abort(self, context, code: grpc.StatusCode, details: str) -> None:
        self.metrics.count_error(code.name.lower())
        await context.abort(code, details)


async def _run(in_thread: bool, fn: Callable[..., T], *args) -> T:
    return await asyncio.to_thread(fn, *args) if in_thread else fn(*args)
