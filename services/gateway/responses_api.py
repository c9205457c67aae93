"""OpenAI's Responses API (`POST /v1/responses`), as vLLM serves it: a request becomes the chat
request it means, which the chat path generates; its chat output becomes a response.

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

Out: `output` items in order: `reasoning` (a reasoning model's thinking, with
`--reasoning-parser`), a `message` with one `output_text` part, and a `function_call` per call;
`status` "incomplete" with `incomplete_details.reason` "max_output_tokens" when the limit cut
it. A stream is the API's typed events (`response.created`, `response.output_text.delta`, ...,
`response.completed`), each with its `sequence_number`; an error after the first event is an
`error` event.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from redis.exceptions import RedisError

from services.gateway.choices import first_choice
from services.gateway.errors import APIError, to_api_error
from services.gateway.openai_protocol import ChatCompletionRequest
from services.gateway.openai_responses import ResponseBuilder
from services.gateway.pipeline import Delta, ModelText
from services.gateway.response_store import MemoryResponseStore, RedisResponseStore, StoredResponse

log = logging.getLogger("baton.gateway.responses")
ROLES = ("user", "system", "developer", "assistant")
ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the `include` that asks for them


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
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    truncation: Literal["auto", "disabled"] | None = None

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
                            ("top_p", self.top_p), ("user", self.user)):
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
        try:
            return ChatCompletionRequest.model_validate(chat)
        except ValidationError as e:
            first = e.errors(include_url=False)[0]
            field = ".".join(str(p) for p in first.get("loc", ()))
            message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
            raise APIError(400, f"{field}: {message}" if field else message, param=field or None) from None

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
                messages.append({"role": item["role"], "content": _text(item.get("content"), i)})
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


def fit_to_context(chat: ChatCompletionRequest, tokenizer: ModelText) -> ChatCompletionRequest:
    """`truncation: "auto"`: `chat` with its conversation's oldest turns left out, as few as make its
    prompt fit the context with room for `max_output_tokens` (one token when none is set). What is left
    starts at a user message, after the instructions. Unchanged when it fits, or when even its last
    user turn does not (the context check then refuses it as it would without truncation)."""
    if tokenizer.max_model_len is None:
        return chat
    room = tokenizer.max_model_len - (chat.completion_budget or 1)
    messages, options = chat.messages, chat.chat_options()
    first = 1 if messages[0].role in ("system", "developer") else 0  # the instructions stay

    def fits(start: int) -> bool:
        kept = [m.as_template_input() for m in (*messages[:first], *messages[start:])]
        try:
            prompt = tokenizer.apply_chat_template(
                kept, add_generation_prompt=options.add_generation_prompt, tools=options.tools,
                continue_final_message=options.continue_final_message, **options.template_kwargs)[1]
        except ValueError:  # the template refuses it: the chat path says so, for the whole conversation
            return True
        return len(prompt) <= room

    starts = [i for i in range(first + 1, len(messages)) if messages[i].role == "user"]
    if fits(first) or not starts or not fits(starts[-1]):
        return chat
    low, high = 0, len(starts) - 1  # the earliest start that fits: the prompt shrinks as it moves on
    while low < high:
        middle = (low + high) // 2
        if fits(starts[middle]):
            high = middle
        else:
            low = middle + 1
    return chat.model_copy(update={"messages": [*messages[:first], *messages[starts[low]:]]})


def _stored_item(item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    stored = {"id": item.get("id") or _item_id(ITEM_ID_PREFIXES.get(kind, "item")), **item, "type": kind}
    if kind == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        stored["content"] = [{"type": part, "text": item["content"]}]
    return stored


def _text(content: Any, index: int) -> str:
    """A message item's text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"input[{index}].content must be a string or a list of parts", param=f"input[{index}]")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"input[{index}].content: parts of type {kind!r} are not supported (text only)",
                           param=f"input[{index}].content")
        texts.append(str(part.get("text", "")))
    return "\n".join(texts)


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
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return fmt  # json_object, or what chat refuses by name


class ResponsesShape:
    """One request's response in the Responses API's shape, from its chat output (`builder`).
    Once complete it goes into `store` with `conversation` (the input items it answers, the
    earlier turns' first), unless the request said `store: false`; `store` None stores nothing."""

    def __init__(self, request: ResponsesRequest, builder: ResponseBuilder,
                 store: MemoryResponseStore | RedisResponseStore | None = None,
                 conversation: Sequence[dict[str, Any]] = ()):
        self.request = request
        self.builder = builder
        self.id = builder.id
        self.created_at = int(time.time())
        self.store = store if request.store else None
        self.conversation = list(conversation)

    async def keep(self, response: dict[str, Any]) -> None:
        """Store the complete `response`, before the client has it: a next request may continue it
        as soon as it does. A store that fails (Redis down) is logged; the response still goes out."""
        if self.store is None:
            return
        try:
            await self.store.put(StoredResponse(response, self.conversation))
        except (RedisError, OSError) as e:
            log.warning("response %s not stored: %s: %s", self.id, type(e).__name__, e)

    def whole(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The response from chat's whole body."""
        [choice] = chat["choices"]
        message, output = choice["message"], []
        if message.get("reasoning") is not None:
            output.append(_reasoning_item(_item_id("rs"), message["reasoning"], "completed"))
        if message.get("content") or not message.get("tool_calls"):
            item = _message_item(_item_id("msg"), message.get("content") or "", "completed")
            item["content"][0]["logprobs"] = (choice.get("logprobs") or {}).get("content") or []
            output.append(item)
        output += [_call_item(_item_id("fc"), call, "completed") for call in message.get("tool_calls") or []]
        return self._response(output, choice["finish_reason"], chat["usage"])

    async def events(self, choices: AsyncIterator[tuple[int, Delta]], prompt_param: str) -> AsyncIterator[bytes]:
        """The stream: APIError before the first event (the response's status then), an `error`
        event after it."""
        try:
            first = await first_choice(choices, prompt_param)
            events = _StreamedItems(self)
            yield events.event("response.created", response=self._response([], None, None))
            yield events.event("response.in_progress", response=self._response([], None, None))
            try:
                async for index, delta in _after(first, choices):
                    chunk = events.chunk(self.builder.chunk(index, delta, include_usage=False))
                    if events.completed is not None:
                        await self.keep(events.completed)
                    for event in chunk:
                        yield event
            except Exception as e:  # after the 200 went out: the error travels as an event
                error = to_api_error(e, prompt_param)
                yield events.event("error", code=error.code, message=error.message, param=error.param)
        finally:
            await choices.aclose()

    def pending(self, status: str, error: APIError | None = None) -> dict[str, Any]:
        """The response with no output yet: "queued", "in_progress", or ended so ("cancelled", or
        "failed" with `error`)."""
        response = self._response([], None, None)
        response["status"] = status
        if error is not None:
            response["error"] = {"code": error.code or error.type, "message": error.message}
        return response

    def _response(self, output: list[dict[str, Any]], finish_reason: str | None,
                  usage: dict[str, Any] | None) -> dict[str, Any]:
        request = self.request
        status = "in_progress" if finish_reason is None else "incomplete" if finish_reason == "length" else "completed"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": self.builder.model,
            "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "temperature": request.temperature, "top_p": request.top_p, "tools": request.tools or [],
            "tool_choice": request.tool_choice or "auto", "parallel_tool_calls": request.parallel_tool_calls,
            "text": request.text or {"format": {"type": "text"}}, "store": self.store is not None,
            "background": request.background, "previous_response_id": request.previous_response_id,
            "metadata": request.metadata or {}, "user": request.user, "top_logprobs": request.top_logprobs,
            "truncation": request.truncation or "disabled",
            "output": output, "usage": _usage(usage) if usage is not None else None,
        }


class _StreamedItems:
    """The output items of a stream as chat chunks build them: each opened on its first text,
    closed when the next begins or the reply ends."""

    def __init__(self, shape: ResponsesShape):
        self.shape = shape
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []  # items done, in order
        self.open: tuple[str, dict[str, Any]] | None = None  # ("reasoning" | "message", its item)
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool call index -> its function_call item
        self.completed: dict[str, Any] | None = None  # the response, once its last chunk came
        # Token logprobs not yet sent: they go out with the next text of the message (a token may add
        # no text yet, or thinking), or with the message's end.
        self.logprobs: list[dict[str, Any]] = []

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: ".encode() + json.dumps(body, separators=(",", ":"),
                                                              ensure_ascii=False).encode() + b"\n\n"

    def chunk(self, chat_chunk: dict[str, Any]) -> list[bytes]:
        [choice] = chat_chunk["choices"]
        delta, events = choice["delta"], []
        self.logprobs += (choice.get("logprobs") or {}).get("content") or []
        if delta.get("reasoning"):
            events += self._text("reasoning", delta["reasoning"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            events += self._call(call)
        if choice["finish_reason"] is not None:
            if not self.output and self.open is None and not self.calls:
                events += self._text("message", "")  # an empty reply is an empty message
            events += self._close()
            events += [self._close_call(index) for index in sorted(self.calls)]
            self.output += [self.calls[index] for index in sorted(self.calls)]
            self.completed = self.shape._response(self.output, choice["finish_reason"], self.shape.builder.usage)
            events.append(self.event("response.completed", response=self.completed))
        return events

    def _text(self, kind: str, text: str) -> list[bytes]:
        events = []
        if self.open is None or self.open[0] != kind:
            events += self._close()
            item = (_reasoning_item(_item_id("rs"), "", "in_progress") if kind == "reasoning"
                    else _message_item(_item_id("msg"), "", "in_progress"))
            self.open = (kind, item)
            events.append(self.event("response.output_item.added", output_index=len(self.output), item=item))
            events.append(self.event("response.content_part.added", **self._where(), part=_part(kind, "")))
        item = self.open[1]
        item["content"][0]["text"] += text
        if kind == "reasoning":
            events.append(self.event("response.reasoning_text.delta", **self._where(), delta=text))
            return events
        logprobs, self.logprobs = self.logprobs, []
        item["content"][0]["logprobs"] += logprobs
        events.append(self.event("response.output_text.delta", **self._where(), delta=text, logprobs=logprobs))
        return events

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        kind, item = self.open
        part = item["content"][0]
        if kind == "reasoning":
            done = self.event("response.reasoning_text.done", **self._where(), text=part["text"])
        else:
            part["logprobs"] += self.logprobs
            self.logprobs = []
            done = self.event("response.output_text.done", **self._where(), text=part["text"],
                              logprobs=part["logprobs"])
        events = [done, self.event("response.content_part.done", **self._where(), part=part)]
        item["status"] = "completed"
        events.append(self.event("response.output_item.done", output_index=len(self.output), item=item))
        self.output.append(item)
        self.open = None
        return events

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open[1]["id"], "output_index": len(self.output), "content_index": 0}

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        events = self._close()
        index = call.get("index", 0)
        output_index = len(self.output) + index
        item = self.calls.get(index)
        if item is None:
            function = call.get("function", {})
            item = self.calls[index] = _call_item(_item_id("fc"), {"id": call.get("id"), "function": {
                "name": function.get("name"), "arguments": ""}}, "in_progress")
            events.append(self.event("response.output_item.added", output_index=output_index, item=item))
        arguments = call.get("function", {}).get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=output_index, delta=arguments))
        return events

    def _close_call(self, index: int) -> bytes:
        item = self.calls[index]
        item["status"] = "completed"
        return b"".join([
            self.event("response.function_call_arguments.done", item_id=item["id"],
                       output_index=len(self.output) + index, arguments=item["arguments"]),
            self.event("response.output_item.done", output_index=len(self.output) + index, item=item)])


async def _after(first: tuple[int, Delta], rest: AsyncIterator[tuple[int, Delta]]
                 ) -> AsyncIterator[tuple[int, Delta]]:
    yield first
    async for choice in rest:
        yield choice


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [_part("reasoning", text)],
            "status": status}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [_part("message", text)]}


def _call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    function = call["function"]
    return {"type": "function_call", "id": item_id, "call_id": call.get("id"), "name": function["name"],
            "arguments": function["arguments"], "status": status}


def _usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    return {"input_tokens": chat_usage["prompt_tokens"], "output_tokens": chat_usage["completion_tokens"],
            "total_tokens": chat_usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens_details": {
                "reasoning_tokens": chat_usage.get("completion_tokens_details", {}).get("reasoning_tokens", 0)}}

