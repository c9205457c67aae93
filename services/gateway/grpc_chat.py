"""A chat request's reply on the gRPC API, read as the HTTP API reads it: the answer's text, a
reasoning model's thinking (`--reasoning-parser`) and tool calls (forced by `tool_choice`, or
the model's own with `--tool-call-parser`), by the HTTP API's own chat ResponseBuilder.

The request's `tools_json` and `tool_choice_json` are OpenAI's chat `tools` and `tool_choice`
as JSON; the tools reach the chat template, and a forced choice guides the text to the call.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from protos import gateway_pb2
from services.gateway.deltas import Delta
from services.gateway.errors import APIError
from services.gateway.openai_responses import ResponseBuilder
from services.gateway.reasoning_parsers import ReasoningReader, reasoning_reader
from services.gateway.structured_output import is_guided
from services.gateway.tool_calls import BadToolError, ForcedToolCall, effective_tool_choice, forced_tool_call
from services.gateway.tool_parsers import ToolCallSyntax, call_ids, needs_a_parser, syntax_for


@dataclass
class ChatRequestTools:
    """What a gRPC chat request asks of tools: the tools (None: none), what its choice forces, and
    whether the model's own calls are read out of its text."""

    tools: list[dict[str, Any]] | None
    choice: str | dict[str, Any] | None  # tool_choice_json's
    forced: ForcedToolCall | None
    syntax: ToolCallSyntax | None  # what the model's own calls are read with, if they are
    call_id: Callable[[], str]  # a new call's id

    @property
    def reads_calls(self) -> bool:
        return self.syntax is not None

    @classmethod
    def of(cls, request: gateway_pb2.GenerateRequest, tool_call_parser: str | None) -> ChatRequestTools:
        tools = _json(request.tools_json, "tools_json", list) if request.tools_json else None
        choice = _json(request.tool_choice_json, "tool_choice_json", (str, dict)) if request.tool_choice_json else None
        try:
            forced = forced_tool_call(tools, choice)
        except ValueError as e:  # about a tool, or about the choice among them
            raise APIError(400, str(e), param="tools_json" if isinstance(e, BadToolError) else "tool_choice_json") \
                from None
        if forced is not None and is_guided(request.sampling):
            raise APIError(400, "a forced tool call and a guided_regex or guided_grammar cannot both be asked for",
                           param="sampling")
        reads_calls = bool(tools) and effective_tool_choice(tools, choice) == "auto"
        if reads_calls and tool_call_parser is None:
            raise needs_a_parser("tool_choice_json")
        return cls(tools, choice, forced, syntax_for(tool_call_parser, tools) if reads_calls else None,
                   call_ids(tool_call_parser))


class ChatReply:
    """One chat request's output, each of its `num_choices` choices', as GenerateChunks and a
    GenerateComplete's fields."""

    def __init__(self, request_id: str, model: str, tools: ChatRequestTools, reasoning: ReasoningReader | None,
                 num_choices: int = 1):
        self.builder = ResponseBuilder(
            kind="chat", response_id=request_id, model=model, num_choices=num_choices,
            prompt_of_choice=[0] * num_choices, token_text=str, want_logprobs=False, forced_tool_call=tools.forced,
            tool_call_syntax=tools.syntax, call_id=tools.call_id, reasoning=reasoning)
        self.finish_reasons: list[str | None] = [None] * num_choices  # by choice, as read

    @classmethod
    def start(cls, request: gateway_pb2.GenerateRequest, request_id: str, model: str, tokenizer,
              tool_call_parser: str | None, reasoning_parser: str | None,
              num_choices: int = 1) -> tuple[ChatReply, ChatRequestTools]:
        tools = ChatRequestTools.of(request, tool_call_parser)
        reader = (reasoning_reader(reasoning_parser, tokenizer, is_guided(request.sampling)) if tools.forced is None
                  else None)
        return cls(request_id, model, tools, reader, num_choices), tools

    @property
    def reasoning(self) -> ReasoningReader | None:
        return self.builder.reasoning

    def reasoning_tokens(self, index: int) -> int | None:
        """Choice `index`'s tokens of thinking; None without a reasoning parser."""
        return self.builder.choices[index].reasoning_tokens if self.reasoning is not None else None

    def chunk(self, index: int, delta: Delta) -> gateway_pb2.GenerateChunk:
        """The stream's chunk for choice `index`'s `delta`: its text, thinking and tool calls as read so far."""
        [choice] = self.builder.chunk(index, delta, include_usage=False)["choices"]
        self.finish_reasons[index] = choice["finish_reason"]
        message = choice["delta"]
        return gateway_pb2.GenerateChunk(
            text=message.get("content") or "", reasoning=message.get("reasoning") or "",
            tool_calls=_tool_calls(message.get("tool_calls") or []), token_ids=delta.token_ids,
            logprobs=delta.logprobs, prompt_logprobs=delta.prompt_logprobs, index=index)

    def add(self, index: int, delta: Delta) -> None:
        self.builder.add(index, delta)

    def whole(self, index: int) -> tuple[str, str, list[gateway_pb2.ToolCall]]:
        """(text, reasoning, tool calls) of choice `index`'s whole reply; sets its finish reason."""
        choice = self.builder.whole()["choices"][index]
        self.finish_reasons[index] = choice["finish_reason"]
        message = choice["message"]
        return message["content"] or "", message.get("reasoning") or "", _tool_calls(message["tool_calls"])


def _tool_calls(calls: Sequence[dict[str, Any]]) -> list[gateway_pb2.ToolCall]:
    return [gateway_pb2.ToolCall(index=call.get("index", i), id=call.get("id") or "",
                                 name=call.get("function", {}).get("name") or "",
                                 arguments=call.get("function", {}).get("arguments") or "")
            for i, call in enumerate(calls)]


def _json(text: str, field: str, kind: type | tuple[type, ...]) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(400, f"{field} is not JSON: {e}", param=field) from None
    if not isinstance(value, kind):
        raise APIError(400, f"{field} has the wrong shape", param=field)
    return value

