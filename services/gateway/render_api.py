"""vLLM's render endpoints, `POST /v1/chat/completions/render` and `POST /v1/completions/render`: a
chat or completions request made into what the tokens API (tokens_api.py) takes, without generating
anything: the prompt's token ids (rendered and encoded as the request itself would be) and its
sampling parameters by vLLM's names, `max_tokens` resolved as the request would have it (chat's
without one: what the context leaves), its structured output or forced tool call as the regex or
grammar that guides it. A router tokenizes in one place so and sends `/inference/v1/generate`
wherever it likes (llm-d's way); the same prompt then gives the same tokens. The chat answer is one
such request, the completions answer a list of them, one per prompt. What the tokens API cannot
carry is refused: beam search, best_of over n, max_tokens 0.
"""
from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from services.gateway.chat_request import ChatCompletionRequest
from services.gateway.completion_request import CompletionRequest, pipeline_prompt
from services.gateway.errors import APIError, to_api_error
from services.gateway.http_body import parsed_body
from services.gateway.openai_protocol import SamplingFields
from services.gateway.tokens_api import SAMPLING_FIELDS
from services.gateway.tool_parsers import with_template_call_ids
from services.tokenizer.chat_template import ChatOptions

if TYPE_CHECKING:
    from services.gateway.http_app import GatewayState

# Written from what the request resolves to, not copied as it came.
RESOLVED = frozenset({"structured_outputs", "logprobs", "max_tokens"})


def tokens_request(body: SamplingFields, prompt: Sequence[int], max_tokens: int, logprobs: int | None,
                   model: str) -> dict[str, Any]:
    """The tokens API's request for `prompt` under `body`'s sampling."""
    sampling = body.model_dump(include=SAMPLING_FIELDS - RESOLVED, exclude_none=True)
    sampling["max_tokens"] = max_tokens
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    guide = body.output_guide
    if guide is not None:
        sampling["structured_outputs"] = {"regex": guide.regex} if guide.regex is not None else {
            "grammar": guide.grammar}
    return {"request_id": uuid.uuid4().hex, "token_ids": list(prompt), "features": None, "sampling_params": sampling,
            "model": model, "stream": body.stream,
            "stream_options": body.stream_options.model_dump() if body.stream_options else None,
            "cache_salt": body.cache_salt, "priority": body.priority, "kv_transfer_params": None}


def _refuse_what_tokens_cannot_carry(body: SamplingFields) -> None:
    if body.use_beam_search:
        raise APIError(400, "use_beam_search is not rendered: the tokens API samples", param="use_beam_search")


def add_render_routes(app: FastAPI, state: GatewayState, check_model: Callable[[str], str | None]) -> None:
    """`check_model(model)`: the LoRA adapter `model` names (None: the model itself), or a 404."""
    prompts = state.pipeline.prompts

    async def rendered(body: SamplingFields, prompt_param: str, max_tokens: int | None, logprobs: int | None,
                       prompt_text: str | None = None, prompt_token_ids: Sequence[int] | None = None,
                       messages: list[dict[str, Any]] | None = None, chat_options: ChatOptions = ChatOptions(),
                       add_special_tokens: bool = True) -> dict[str, Any]:
        try:
            prompt = await prompts.encode(f"render-{uuid.uuid4().hex}", prompt_text, prompt_token_ids, messages,
                                          chat_options, add_special_tokens)
            if body.truncate_prompt_tokens is not None:
                prompt = prompts.truncated(prompt, body.truncate_prompt_tokens)
            params = body.sampling(max_tokens, logprobs, 0, defaults=prompts.generation_defaults)
            prompts.check_context(prompt, params)  # and what fits, for a request that gave no max_tokens
        except Exception as e:
            raise to_api_error(e, prompt_param) from e
        return tokens_request(body, prompt, params.max_tokens, logprobs, body.model)

    async def render_chat(request: Request):
        body = state.chat_serving.as_served(await parsed_body(request, ChatCompletionRequest))
        check_model(body.model)
        _refuse_what_tokens_cannot_carry(body)
        messages = with_template_call_ids(body.chat_messages(), state.tool_call_parser)
        return JSONResponse(await rendered(body, "messages", body.completion_budget, body.num_logprobs,
                                           messages=messages, chat_options=body.chat_options()))

    async def render_completions(request: Request):
        body = await parsed_body(request, CompletionRequest)
        check_model(body.model)
        _refuse_what_tokens_cannot_carry(body)
        if body.prompt_embeds:
            raise APIError(400, "a prompt given as embeddings is not rendered: the tokens API takes token ids",
                           param="prompt_embeds")
        if body.max_tokens == 0:
            raise APIError(400, "max_tokens 0 (the prompt alone) is not rendered: the tokens API makes at least "
                                "one token", param="max_tokens")
        if body.num_candidates > body.n:
            raise APIError(400, "best_of greater than n is not rendered: the tokens API keeps every choice",
                           param="best_of")
        return JSONResponse([await rendered(body, "prompt", body.max_tokens, body.logprobs,
                                            **pipeline_prompt(prompt, body.add_special_tokens))
                             for prompt in body.prompts])

    app.add_route("/v1/chat/completions/render", render_chat, methods=["POST"])
    app.add_route("/v1/completions/render", render_completions, methods=["POST"])
