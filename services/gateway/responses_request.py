"""A Responses API request (`POST /v1/responses`) as the chat request it means, which the chat
path generates (responses_api.py shapes its output).

In: `input` (a text, or a list of items: messages with text content, and earlier turns'
`function_call`, `function_call_output` and `reasoning` items, the last the thinking of the
assistant turn after it, as chat's `reasoning_content`), `instructions` (a system message first),
`max_output_tokens`, `temperature`, `top_p`, function `tools` and `tool_choice`, `text.format`
(`json_schema` or `json_object`: structured output), `include: ["message.output_text.logprobs"]`
with `top_logprobs` (each output token's logprob and its top alternatives, as vLLM gives them: the
reply's every token, thinking included), `truncation` ("auto": the conversation's oldest turns left
out of the prompt, as few as make it fit the context; "disabled", the default: a 400),
`previous_response_id` (the conversation goes on from a stored response: its input and output come
before this `input`; its `instructions` do not carry over, as OpenAI's do not). A response is
stored (response_store.py) unless `store` is false or the gateway stores none
(`--responses-ttl-s 0`). `background` (stored, not streamed): the request is answered at once,
"queued", and generated after (background_responses.py).
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.gateway.chat_request import ChatCompletionRequest, chat_request
from services.gateway.errors import APIError
from services.gateway.given_embeddings import GivenImages, ProcessedImage
from services.gateway.openai_protocol import MAX_LOGPROBS
from services.gateway.prompt_encoder import PromptEncoder
from services.gateway.request_aliases import without_nulls

ROLES = ("user", "system", "developer", "assistant")
ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the `include` that asks for them
NULL_IS_DEFAULT = ("stream", "parallel_tool_calls", "store", "background")  # nullable in OpenAI's API
# Chat's fields that come from the Responses API's of other names: a refusal names the one asked.
RESPONSES_NAMES = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format",
                   "reasoning_effort": "reasoning.effort"}


class ResponsesRequest(BaseModel):
    """POST /v1/responses; fields not listed are ignored, as OpenAI's optional ones are by vLLM."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict[str, Any] | None = None  # {"effort": ...}: chat's `reasoning_effort`
    cache_salt: str | None = None  # vLLM's, as chat's

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        return without_nulls(data, NULL_IS_DEFAULT)

    @property
    def wants_logprobs(self) -> bool:
        return OUTPUT_LOGPROBS in (self.include or ())

    def input_items(self) -> list[dict[str, Any]]:
        """`input` as items: a text is one user message."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": self.input}]}]
        return self.input

    def stored_items(self) -> list[dict[str, Any]]:
        """`input_items` as OpenAI lists a stored response's: each with an id and a type, a message's
        text in parts."""
        return [_stored_item(item) for item in self.input_items()]

    def as_chat(self, earlier: Sequence[dict[str, Any]] = ()) -> ChatCompletionRequest:
        """The chat request this one means, after the input items `earlier` (the conversation of the
        response it continues); APIError (400) for what the Responses API asks that cannot be served,
        or what chat refuses."""
        chat: dict[str, Any] = {"model": self.model, "messages": self._messages(earlier), "stream": self.stream}
        for name, value in (("max_completion_tokens", self.max_output_tokens), ("temperature", self.temperature),
                            ("top_p", self.top_p), ("user", self.user), ("cache_salt", self.cache_salt)):
            if value is not None:
                chat[name] = value
        if self.tools:
            chat["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            chat["tool_choice"] = _chat_tool_choice(self.tool_choice)
        chat["parallel_tool_calls"] = self.parallel_tool_calls
        if (response_format := _response_format(self.text)) is not None:
            chat["response_format"] = response_format
        if self.wants_logprobs:
            chat.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        if self.reasoning and self.reasoning.get("effort") is not None:
            chat["reasoning_effort"] = self.reasoning["effort"]
        try:
            return chat_request(chat)
        except APIError as e:
            chats, _, rest = (e.param or "").partition(".")
            if chats not in RESPONSES_NAMES:
                raise
            theirs = RESPONSES_NAMES[chats] + (f".{rest}" if rest else "")
            raise APIError(e.status, e.message.replace(e.param, theirs, 1), param=theirs) from None

    def _messages(self, earlier: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        thought = None  # a reasoning item's text: the thinking of the assistant turn after it
        # An index past the earlier items names this request's own: its errors point into its `input`.
        for i, item in enumerate([*earlier, *self.input_items()], start=-len(earlier)):
            kind = item.get("type", "message")
            if kind == "reasoning":
                thought = _reasoning_text(item, i)
                continue
            if kind == "message":
                if item.get("role") not in ROLES:
                    raise APIError(400, f"input[{i}].role must be one of {', '.join(ROLES)}", param=f"input[{i}].role")
                messages.append({"role": item["role"], "content": _content(item.get("content"), i)})
            elif kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
                previous = messages[-1] if messages else None
                if previous is not None and previous["role"] == "assistant" and previous.get("tool_calls"):
                    previous["tool_calls"].append(call)  # calls made together are one assistant turn
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                                 "content": output if isinstance(output, str) else json.dumps(output)})
            else:
                raise APIError(400, f"input[{i}]: items of type {kind!r} are not supported", param=f"input[{i}]")
            if thought is not None and messages[-1]["role"] == "assistant":
                # As chat takes an earlier turn's thinking: templates that show it (Qwen3's, between
                # tool calls) read `reasoning_content`; the others leave it out.
                messages[-1]["reasoning_content"] = thought
            thought = None
        return messages


def fit_to_context(chat: ChatCompletionRequest, prompts: PromptEncoder, images: GivenImages | None = None
                   ) -> tuple[ChatCompletionRequest, GivenImages | None]:
    """`truncation: "auto"`: `chat` with its conversation's oldest turns left out, as few as make its
    prompt fit the context with room for `max_output_tokens` (one token when none is set), and those of its
    `images` (its messages', in order) the turns kept hold. What is left starts at a user message, after the
    instructions. Unchanged when it fits, or when even its last user turn does not (the context check then
    refuses it as it would without truncation)."""
    tokenizer = prompts.tokenizer
    if tokenizer.max_model_len is None:
        return chat, images
    room = tokenizer.max_model_len - (chat.completion_budget or 1)
    messages, options = chat.messages, prompts.chat_options(chat.chat_options())
    first = 1 if messages[0].role in ("system", "developer") else 0  # the instructions stay
    given = iter(images.images if images is not None else ())
    by_message = [[next(given) for _ in message.media_sources] for message in messages]

    def kept_images(start: int) -> list[ProcessedImage]:
        return [image for i in (*range(first), *range(start, len(messages))) for image in by_message[i]]

    def fits(start: int) -> bool:
        kept = [m.as_template_input() for m in (*messages[:first], *messages[start:])]
        sizes = [image.size for image in kept_images(start)]
        try:
            prompt = tokenizer.apply_chat_template(kept, image_sizes=sizes, **options.as_template_inputs())[1]
        except ValueError:  # the template refuses it: the chat path says so, for the whole conversation
            return True
        return len(prompt) <= room

    starts = [i for i in range(first + 1, len(messages)) if messages[i].role == "user"]
    if fits(first) or not starts or not fits(starts[-1]):
        return chat, images
    low, high = 0, len(starts) - 1  # the earliest start that fits: the prompt shrinks as it moves on
    while low < high:
        middle = (low + high) // 2
        if fits(starts[middle]):
            high = middle
        else:
            low = middle + 1
    kept_chat = chat.model_copy(update={"messages": [*messages[:first], *messages[starts[low]:]]})
    kept = kept_images(starts[low])
    return kept_chat, GivenImages(tuple(kept)) if kept else None


def _stored_item(item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    stored = {"id": item.get("id") or new_item_id(ITEM_ID_PREFIXES.get(kind, "item")), **item, "type": kind}
    if kind == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        stored["content"] = [{"type": part, "text": item["content"]}]
    return stored


def _content(content: Any, index: int) -> str | list[dict[str, Any]]:
    """A message item's content as chat's: a string, its text parts joined, or (with an input_image among
    them) chat's text and image_url parts in order."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"input[{index}].content must be a string or a list of parts", param=f"input[{index}]")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise APIError(400, f"input[{index}].content: parts of type {kind!r} are not supported (text, and "
                                "input_image with an image_url)", param=f"input[{index}].content")
    if any(part["type"] == "image_url" for part in parts):
        return parts
    return "\n".join(part["text"] for part in parts)


def _reasoning_text(item: dict[str, Any], index: int) -> str:
    """A reasoning item's thinking: its content's text (as this API returns it), else its summary's."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
        raise APIError(400, f"input[{index}]: a reasoning item's content and summary are lists of parts",
                       param=f"input[{index}]")
    return "\n".join(str(p.get("text", "")) for p in parts)


def _chat_tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    """A Responses function tool (its fields at the top) as chat's (under `function`)."""
    if tool.get("type") != "function":
        raise APIError(400, f"tools[{index}]: only function tools are supported, got {tool.get('type')!r}",
                       param=f"tools[{index}].type")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format`; None for plain text."""
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object, such as {\"type\": \"json_schema\", ...}",
                       param="text.format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return fmt  # json_object, or what chat refuses by name


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"
