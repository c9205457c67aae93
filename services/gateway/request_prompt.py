"""What a generation request's inputs become before any worker hears of it: its prompt's token ids (encoded or
rendered by the tokenizer, or as given, or a placeholder a row of a prompt given as embeddings; cut to
`truncate_prompt_tokens`), and its sampling parameters carrying what goes with them (the embeddings' rows and the
images, their bytes beside them; a thinking budget's marks; the tokens a guided reply's guide waits for), each
checked as vLLM checks it."""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from protos import common_pb2
from services.gateway.given_embeddings import PLACEHOLDER_TOKEN_ID, GivenImages, GivenRows, check_embedded
from services.gateway.prompt_encoder import PromptEncoder
from services.gateway.reasoning_config import ThinkingMarkers, fill_thinking_budget
from services.gateway.request_bytes import BulkInputs
from services.gateway.request_errors import InvalidRequestError
from services.gateway.request_trace import RequestTrace
from services.gateway.structured_output import is_guided
from services.tokenizer.chat_template import ChatOptions
from services.tokenizer.stop_strings import Stop


@dataclass(frozen=True)
class RequestPrompt:
    """Exactly one of `text`, `token_ids`, `messages` (rendered as `chat_options` say) and `embeds` (a prompt given
    as embeddings); `images`: the messages' images, in order. `add_special_tokens`: a `text` is encoded with the
    tokenizer's (its BOS); `truncate_tokens`: only the prompt's last that many tokens go to the model (-1: as many
    as its context holds)."""

    text: str | None = None
    token_ids: Sequence[int] | None = None
    messages: Sequence[Mapping[str, str]] | None = None
    embeds: common_pb2.PromptEmbeds | None = None
    images: GivenImages | None = None
    chat_options: ChatOptions = ChatOptions()
    add_special_tokens: bool = True
    truncate_tokens: int | None = None


@dataclass(frozen=True)
class PromptChecks:
    """The gateway's settings a request's prompt and parameters are held to."""

    thinking_markers: ThinkingMarkers | None = None  # what keeps a thinking_token_budget; None: none can be kept
    max_logprobs: int = -1  # top logprobs a request may ask for per token (vLLM's --max-logprobs); -1: any


async def prepared_prompt(prompts: PromptEncoder, request_id: str, given: RequestPrompt,
                          params: common_pb2.SamplingParams, stop: Sequence[Stop], checks: PromptChecks,
                          guide_after: Callable[[Sequence[int]], Sequence[int] | None] | None,
                          spans: RequestTrace) -> tuple[Sequence[int], BulkInputs | None]:
    """The prompt's token ids, and the bytes of the inputs `params` (filled in here) now carry (None for none).
    InvalidRequestError (incl. ContextLengthError) for what cannot be a request."""
    if sum(x is not None for x in (given.text, given.token_ids, given.messages, given.embeds)) != 1:
        raise InvalidRequestError("exactly one of prompt_text, prompt_token_ids, messages and prompt_embeds is "
                                  "required")
    check_embedded(params, given.embeds)
    token_ids = [PLACEHOLDER_TOKEN_ID] * given.embeds.num_rows if given.embeds is not None else given.token_ids
    if any(not s for s in stop):
        raise InvalidRequestError("stop strings must be non-empty", param="stop")
    fill_thinking_budget(params, checks.thinking_markers)
    _check_num_logprobs(params, checks.max_logprobs)
    with spans.phase("tokenize"):
        prompt = await prompts.encode(request_id, given.text, token_ids, given.messages, given.chat_options,
                                      given.add_special_tokens, given.images.sizes if given.images is not None else ())
        if given.truncate_tokens is not None:
            prompt = prompts.truncated(prompt, given.truncate_tokens)
    rows = None
    if given.embeds is not None:  # MBs of rows copied and hashed: off the event loop
        rows = await asyncio.to_thread(GivenRows.of, given.embeds, len(prompt))
        rows.given_to(params)
    if given.images is not None:
        given.images.given_to(params)
    if guide_after is not None and is_guided(params):
        guide_token_ids = guide_after(prompt)
        if guide_token_ids:
            params.ClearField("guide_after_token_id")
            params.guide_after_token_ids[:] = guide_token_ids
    return prompt, BulkInputs(given.images, rows) if given.images is not None or rows is not None else None


def _check_num_logprobs(params: common_pb2.SamplingParams, max_logprobs: int) -> None:
    for name in ("logprobs", "prompt_logprobs"):
        if max_logprobs != -1 and params.HasField(name) and getattr(params, name) > max_logprobs:
            raise InvalidRequestError(f"{name}: at most {max_logprobs} top logprobs (the gateway's --max-logprobs), "
                                      f"got {getattr(params, name)}", param=name)
