"""OpenAI's `POST /v1/embeddings`, as vLLM serves it: each input's embedding, the served model's
last hidden state at the input's last token (the pooling vLLM gives a decoder-only model, as
embedding models such as Qwen3-Embedding and e5-mistral are trained for), L2-normalized unless
`normalize` is false (vLLM's extra), cut to its first `dimensions` numbers before (OpenAI's, for
Matryoshka models); `encoding_format` "float" or "base64" (little-endian float32s, OpenAI's).

`input` takes OpenAI's four shapes: a text, a list of texts, a list of token ids, a list of such
lists. Texts are encoded as prompts are, with the tokenizer's special tokens (vLLM's default;
`add_special_tokens: false` leaves them out); `truncate_prompt_tokens` (vLLM's) keeps an
input's last N tokens. Instead of `input`, vLLM's `messages`: a conversation the chat template renders into one input
(`add_generation_prompt` false by default, `continue_final_message`, `chat_template_kwargs`, a
`chat_template` of the request's own where the gateway trusts them; special tokens added only with
`add_special_tokens`). Each input is one Embed call (protos/embed.proto) to the least loaded
prefill worker (a decode worker where there is no prefill pool), all at once; `usage` counts their
tokens. A `model` naming a LoRA adapter computes with it. Each input counts as a request against
`--max-num-requests` (past it, 429).

Errors (400 unless said): an empty input, or an empty text or list in it (as OpenAI's); an input
longer than the context (`context_length_exceeded`); `dimensions` below 1 or over the model's
hidden size; a token id outside the vocabulary; an unknown model (404).
"""
from __future__ import annotations

import asyncio
import base64
import struct
import time
from typing import Annotated, Any, Literal

import grpc
from pydantic import BaseModel, ConfigDict, Field, StrictStr, model_validator

from protos import embed_pb2, embed_pb2_grpc
from services.gateway.chat_messages import ChatMessage
from services.gateway.errors import APIError, FieldError, to_api_error
from services.gateway.openai_protocol import TokenId
from services.gateway.pipeline import RequestPipeline
from services.gateway.request_errors import OverloadedError, from_rpc_error
from services.tokenizer.chat_template import ChatOptions, check_template_kwargs

Input = StrictStr | list[StrictStr] | list[TokenId] | list[list[TokenId]]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    input: Input | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    # vLLM's extras: a conversation instead of `input`, rendered by the chat template as one input
    # (no generation prompt unless asked for), and how.
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # the request's own (--trust-request-chat-template only)
    add_special_tokens: bool | None = None  # None: vLLM's defaults, true for `input` and false for `messages`
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | None = None
    normalize: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.input is None) == (self.messages is None):
            raise FieldError("input", "give either input or messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError("continue_final_message",
                             "continue_final_message and add_generation_prompt cannot both be true")
        check_template_kwargs(self.chat_template_kwargs or {})
        return self

    def chat_options(self) -> ChatOptions:
        return ChatOptions(self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs or {},
                           template=self.chat_template, add_special_tokens=bool(self.add_special_tokens))

    def inputs(self) -> list[str | list[int] | list[dict[str, Any]]]:
        """Each input: a text, its token ids, or a conversation (as chat templates read messages);
        APIError for an empty one."""
        if self.messages is not None:
            if not self.messages:
                raise APIError(400, "messages must not be empty", param="messages")
            return [[m.as_template_input() for m in self.messages]]
        given = self.input
        if isinstance(given, str) or (given and isinstance(given[0], int)):
            given = [given]
        if not given or any(len(one) == 0 for one in given):
            raise APIError(400, "input must not be empty, nor hold an empty text or token list", param="input")
        return list(given)


async def embed(pipeline: RequestPipeline, body: EmbeddingRequest, lora: str | None, model: str,
                request_id: str, max_model_len: int | None) -> dict:
    """The response body of `body`, an EmbeddingRequest for `model` (`lora`: the adapter it names)."""
    replies, num_tokens = await embeddings(pipeline, body, lora, request_id, max_model_len)
    return {"id": request_id, "object": "list", "created": int(time.time()), "model": model,
            "data": [{"object": "embedding", "index": index,
                      "embedding": encoded(list(reply.embedding), body.encoding_format)}
                     for index, reply in enumerate(replies)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


async def embeddings(pipeline: RequestPipeline, body: EmbeddingRequest, lora: str | None, request_id: str,
                     max_model_len: int | None, classify: bool = False,
                     per_token: bool = False) -> tuple[list[embed_pb2.EmbedResponse], int]:
    """(each input's Embed reply: its embedding, or with `classify` its classifier's probabilities,
    with `per_token` each of its tokens'; the tokens of them all); each input counts as a request
    against --max-num-requests while it is computed."""
    inputs = body.inputs()
    await pipeline.pause.passed()
    try:
        pipeline.admit(len(inputs))  # each input a request, as each choice of a generation is
    except OverloadedError as e:
        raise to_api_error(e, "input") from None
    try:
        token_ids = await asyncio.gather(*(_token_ids(pipeline, f"{request_id}-{index}", one, body)
                                           for index, one in enumerate(inputs)))
        for index, ids in enumerate(token_ids):
            if max_model_len is not None and len(ids) > max_model_len:
                raise APIError(400, f"This model's maximum context length is {max_model_len} tokens, but input "
                                    f"{index} has {len(ids)}", param="input", code="context_length_exceeded")
        pool = pipeline.prefill or pipeline.decode
        replies = await asyncio.gather(*(
            _embedding(pool, embed_pb2.EmbedRequest(request_id=f"{request_id}-{index}", token_ids=ids,
                                                    dimensions=body.dimensions or 0, normalize=body.normalize,
                                                    lora_name=lora or "", classify=classify,
                                                    per_token=per_token),
                       pipeline.deadlines.prefill_s)
            for index, ids in enumerate(token_ids)))
    finally:
        pipeline.release(len(inputs))
    return replies, sum(len(ids) for ids in token_ids)


async def _token_ids(pipeline: RequestPipeline, request_id: str, one: str | list[int] | list[dict[str, Any]],
                     body: EmbeddingRequest) -> list[int]:
    if isinstance(one, list) and (not one or isinstance(one[0], int)):
        ids = one
    else:
        is_text = isinstance(one, str)
        try:  # a short one here, a long one by the tokenizer service
            ids = list(await pipeline.prompts.encode(request_id, one if is_text else None, None,
                                                     None if is_text else one, body.chat_options(),
                                                     body.add_special_tokens is not False if is_text else False))
        except Exception as e:
            raise to_api_error(e, "input" if is_text else "messages") from None
    return ids[-body.truncate_prompt_tokens:] if body.truncate_prompt_tokens else ids


async def _embedding(pool, request: embed_pb2.EmbedRequest, timeout_s: float) -> embed_pb2.EmbedResponse:
    try:
        with pool.hold(num_tokens=len(request.token_ids)) as worker:
            reply = await embed_pb2_grpc.EmbeddingsStub(worker.channel).Embed(request, timeout=timeout_s)
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
            param = next((p for p, said in (("dimensions", "dimensions"), ("task", "not tokens"),
                                            ("model", "classification head"))
                          if said in e.details()), "input")
            raise APIError(400, e.details(), param=param) from None
        raise to_api_error(from_rpc_error(e), "input") from None
    except Exception as e:
        raise to_api_error(e, "input") from None
    return reply


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
