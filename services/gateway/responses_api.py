"""OpenAI's Responses API (`POST /v1/responses`), as vLLM serves it: a request becomes the chat
request it means (responses_request.py), which the chat path generates; its chat output becomes a
response, shaped here.

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
from collections.abc import AsyncIterator, Sequence
from typing import Any

from redis.exceptions import RedisError

from services.gateway.choices import first_choice
from services.gateway.deltas import Delta
from services.gateway.errors import APIError, to_api_error
from services.gateway.openai_responses import ResponseBuilder
from services.gateway.response_store import MemoryResponseStore, RedisResponseStore, StoredResponse
from services.gateway.responses_request import ResponsesRequest, new_item_id

log = logging.getLogger("baton.gateway.responses")


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
            output.append(_reasoning_item(new_item_id("rs"), message["reasoning"], "completed"))
        if message.get("content") or not message.get("tool_calls"):
            item = _message_item(new_item_id("msg"), message.get("content") or "", "completed")
            item["content"][0]["logprobs"] = (choice.get("logprobs") or {}).get("content") or []
            output.append(item)
        output += [_call_item(new_item_id("fc"), call, "completed") for call in message.get("tool_calls") or []]
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
        response = {
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
        if self.builder.has_metrics and finish_reason is not None:
            response["metrics"] = self.builder.metrics
        return response


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
            item = (_reasoning_item(new_item_id("rs"), "", "in_progress") if kind == "reasoning"
                    else _message_item(new_item_id("msg"), "", "in_progress"))
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
            item = self.calls[index] = _call_item(new_item_id("fc"), {"id": call.get("id"), "function": {
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

