"""Anthropic's Messages API answered as Anthropic answers it (the request: anthropic_request.py):
a message from chat's output, or its stream of typed events, and errors in Anthropic's shape.

Out: `content` blocks in order: `thinking` (a reasoning model's, with `--reasoning-parser`), `text`,
and a `tool_use` per call (its `input` the call's arguments as an object; a thinking block's `signature`
opaque, as vLLM's); `stop_reason` `end_turn`,
`stop_sequence` (with the `stop_sequence` matched), `max_tokens` or `tool_use`; `usage` with
`input_tokens` (the prompt's tokens not read from the prefix cache), `cache_read_input_tokens` and
`output_tokens`. A stream is `message_start`, a `ping`, each block's `content_block_start`, `_delta`s
(`text_delta`, `thinking_delta` then `signature_delta`, `input_json_delta`) and `content_block_stop`,
then `message_delta`
(the stop reason and the usage) and `message_stop`; an error after the first event is an `error` event.
`POST /v1/messages/count_tokens` answers the prompt's `input_tokens`.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from services.gateway.anthropic_errors import AnthropicError, error_object
from services.gateway.anthropic_request import MessagesRequest
from services.gateway.chat_images import chat_image_sizes
from services.gateway.choices import first_choice
from services.gateway.deltas import Delta
from services.gateway.errors import APIError, to_api_error
from services.gateway.http_body import parsed_body
from services.gateway.openai_responses import ResponseBuilder
from services.gateway.tokenize_api import TokenizeRequest, tokenize

STOP_REASONS = {"length": "max_tokens"}  # any other finish: end_turn, or tool_use after a call
class MessagesShape:
    """One request's message in the Messages API's shape, from its chat output (`builder`)."""

    def __init__(self, builder: ResponseBuilder):
        self.builder = builder

    async def keep(self, response: dict[str, Any]) -> None:
        """(Messages are not stored.)"""

    def whole(self, chat: dict[str, Any]) -> dict[str, Any]:
        [choice] = chat["choices"]
        message, content = choice["message"], []
        if message.get("reasoning"):
            content.append({"type": "thinking", "thinking": message["reasoning"], "signature": _signature()})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        content += [_tool_use(call["id"], call["function"]["name"], _arguments(call["function"]["arguments"]))
                    for call in message.get("tool_calls") or []]
        stop = _stop(choice, bool(message.get("tool_calls")))
        return {**self._message(content, *stop), "usage": _usage(chat["usage"])}

    async def events(self, choices: AsyncIterator[tuple[int, Delta]], prompt_param: str) -> AsyncIterator[bytes]:
        """The stream: AnthropicError before the first event (the response's status then), an `error`
        event after it."""
        try:
            try:
                first = await first_choice(choices, prompt_param)
            except APIError as e:  # answered by FirstEventResponse, not the app's handlers
                raise AnthropicError.of(e) from None
            blocks = _StreamedBlocks()
            chunk = self.builder.chunk(*first, include_usage=False)
            start = self._message([], None, None)
            start["usage"] = {"input_tokens": len(self.builder.choices[0].prompt_token_ids), "output_tokens": 0}
            yield _event("message_start", message=start)
            yield _event("ping")  # as Anthropic's streams go on after their start
            try:
                while True:
                    for event in blocks.chunk(chunk):
                        yield event
                    [choice] = chunk["choices"]
                    if choice["finish_reason"] is not None:
                        stop_reason, stop_sequence = _stop(choice, blocks.has_tool_use)
                        yield _event("message_delta", usage=_usage(self.builder.usage),
                                     delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence})
                        yield _event("message_stop")
                        return
                    chunk = self.builder.chunk(*await anext(choices), include_usage=False)
            except Exception as e:  # after the 200 went out: the error travels as an event
                yield _event("error", error=error_object(to_api_error(e, prompt_param)))
        finally:
            await choices.aclose()

    def _message(self, content: list[dict[str, Any]], stop_reason: str | None,
                 stop_sequence: str | None) -> dict[str, Any]:
        return {"id": self.builder.id, "type": "message", "role": "assistant", "model": self.builder.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence}


class _StreamedBlocks:
    """The content blocks of a stream as chat chunks build them: each started on its first text, stopped
    when the next begins or the message ends."""

    def __init__(self):
        self.index = -1  # the open block's; blocks are numbered as they start
        self.open: str | None = None  # "thinking", "text", or a tool call's chat index as "call:N"
        self.has_tool_use = False

    def chunk(self, chat_chunk: dict[str, Any]) -> list[bytes]:
        [choice] = chat_chunk["choices"]
        delta, events = choice["delta"], []
        if delta.get("reasoning"):
            events += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning"]}))
        if delta.get("content"):
            events += self._start("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            events += self._start(f"call:{call.get('index', 0)}", _tool_use(call.get("id"), function.get("name"), {}))
            self.has_tool_use = True
            if function.get("arguments"):
                events.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
        if choice["finish_reason"] is not None:
            events += self._stop()
        return events

    def _start(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        if self.open == kind:
            return []
        events = self._stop()
        self.index += 1
        self.open = kind
        return [*events, _event("content_block_start", index=self.index, content_block=block)]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", index=self.index, delta=delta)

    def _stop(self) -> list[bytes]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":  # its signature comes last, as Anthropic's stream sends it
            events.append(self._delta({"type": "signature_delta", "signature": _signature()}))
        self.open = None
        return [*events, _event("content_block_stop", index=self.index)]


def add_anthropic_routes(app: FastAPI, state, check_model: Callable[[str], str | None]) -> None:
    """`POST /v1/messages/count_tokens` (`POST /v1/messages` is generation_routes.py's). `state`: the
    gateway's (http_app.GatewayState); `check_model`: a named model's LoRA adapter, or a 404."""
    pipeline = state.pipeline

    async def count_tokens(request: Request) -> JSONResponse:
        chat = state.chat_serving.as_served((await parsed_body(request, MessagesRequest)).as_chat())
        check_model(chat.model)
        options = chat.chat_options()  # as generation renders the message: its effort, documents and all
        asked = TokenizeRequest(messages=chat.messages, tools=options.tools, documents=options.documents,
                                chat_template_kwargs=dict(options.template_kwargs), chat_template=options.template)
        sizes = await chat_image_sizes(state, chat.messages)
        tokens = await tokenize(asked, pipeline.prompts, state.tool_call_parser, sizes)
        return JSONResponse({"input_tokens": len(tokens)})

    app.add_route("/v1/messages/count_tokens", count_tokens, methods=["POST"])


def _signature() -> str:
    """A thinking block's: opaque to clients, which send it back with the block (nothing checks it here)."""
    return uuid.uuid4().hex


def _event(kind: str, **fields: Any) -> bytes:
    body = json.dumps({"type": kind, **fields}, separators=(",", ":"), ensure_ascii=False)
    return f"event: {kind}\ndata: {body}\n\n".encode()


def _stop(choice: dict[str, Any], has_tool_use: bool) -> tuple[str, str | None]:
    """The message's `stop_reason` and `stop_sequence`, from its chat choice's finish (a forced call's is
    chat's "stop", as vLLM's, but Anthropic's is tool_use)."""
    matched = choice.get("stop_reason")
    if choice["finish_reason"] == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    if has_tool_use and choice["finish_reason"] in ("stop", "tool_calls"):
        return "tool_use", None
    return STOP_REASONS.get(choice["finish_reason"], "end_turn"), None


def _tool_use(call_id: str | None, name: str | None, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments}


def _arguments(text: str) -> dict[str, Any]:
    """A call's arguments as `input`, an object: the tool parsers write JSON objects; anything else
    (a call cut off by max_tokens) is given as none."""
    try:
        arguments = json.loads(text or "{}")
    except json.JSONDecodeError:
        return {}
    return arguments if isinstance(arguments, dict) else {}


def _usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"] - cached, "output_tokens": chat_usage["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}
