"""A chat response's tool calls, choice by choice, as its `tool_choice` has them: a named function's
forced call (the text is its arguments), or the calls read out of each choice's text ("required"'s
list, or "auto"'s in the model's own syntax), streamed as they come or read once from a whole one."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.gateway.deltas import Delta
from services.gateway.json_tool_calls import RequiredCalls
from services.gateway.streamed_calls import StreamedCalls, merged_call_deltas
from services.gateway.tool_calls import ForcedToolCall, new_call_id
from services.gateway.tool_parsers import ToolCallSyntax


class ChoiceCalls:
    """The calls of a chat response's `num_choices` choices. Without a forced call or a syntax, a
    choice's text is all content."""

    def __init__(self, num_choices: int, forced_tool_call: ForcedToolCall | None = None,
                 tool_call_syntax: ToolCallSyntax | None = None, call_id: Callable[[], str] = new_call_id,
                 parallel_tool_calls: bool = True):
        # "required": the text is a list of calls, read as the model's own are (json_tool_calls.RequiredCalls)
        if forced_tool_call is not None and forced_tool_call.name is None:
            forced_tool_call, tool_call_syntax = None, RequiredCalls(call_id)
        self.forced_tool_call = forced_tool_call  # the text is a named function's call, sent as `tool_calls`
        # A named function's call, per choice; ids of the gateway's parser's kind (a Mistral model's
        # templates take back only theirs).
        self._call_ids = [call_id() for _ in range(num_choices)]
        # tool_choice "auto" (or "required"): each choice's text read for its calls (tool_parsers.py)
        self.tool_call_syntax = tool_call_syntax
        self.parallel_tool_calls = parallel_tool_calls  # False: a reply's first call only, as vLLM filters them
        self._streamed_calls = ([StreamedCalls(tool_call_syntax) for _ in range(num_choices)]
                                if tool_call_syntax is not None else None)

    @property
    def is_named(self) -> bool:
        """Whether every choice's text is a named function's call."""
        return self.forced_tool_call is not None

    # ---- streaming -------------------------------------------------------------------

    def delta(self, index: int, delta: Delta, answer: str, is_first: bool
              ) -> tuple[dict[str, Any], list[dict[str, Any]] | None]:
        """Choice `index`'s stream chunk delta for `delta` (`answer`: its text after any thinking;
        `is_first`: the choice's first chunk), and with its last delta the calls the choice made."""
        if self.is_named:
            return self._named_delta(index, delta, is_first)
        if self._streamed_calls is not None:
            return self._parsed_delta(index, answer, delta.finish_reason is not None)
        return {"content": answer}, None

    def _named_delta(self, index: int, delta: Delta, is_first: bool) -> tuple[dict[str, Any], None]:
        """A stream chunk's delta for a named function's forced call: its arguments as they come."""
        call: dict[str, Any] = {"index": 0, "function": {"arguments": delta.text}}
        if is_first:  # the call's first piece names it
            call.update(id=self._call_ids[index], type="function")
            call["function"]["name"] = self.forced_tool_call.name
        return {"tool_calls": [call]}, None

    def _parsed_delta(self, index: int, delta_text: str, is_last: bool
                      ) -> tuple[dict[str, Any], list[dict[str, Any]] | None]:
        """A stream chunk's delta under tool_choice "auto", and at the end the calls made: the text before
        any call as it comes, then the calls as they come (streamed_calls.StreamedCalls)."""
        stream = self._streamed_calls[index]
        text, calls = stream.add(delta_text)
        if is_last:
            more_text, more_calls = stream.finish()
            text, calls = text + more_text, merged_call_deltas(calls, more_calls)
        if not self.parallel_tool_calls:
            calls = [call for call in calls if call.get("index", 0) == 0]
        message: dict[str, Any] = {"content": text}
        if calls:
            message["tool_calls"] = calls
        return message, (stream.calls or None) if is_last else None

    # ---- whole -----------------------------------------------------------------------

    def named_call(self, index: int, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """Choice `index`'s whole text as (content, calls): its named function's call, with the id its
        stream's first chunk gave it; a text cut short goes out as content."""
        call = self.forced_tool_call.named_call(text, self._call_ids[index])
        return (None, [call]) if call is not None else (text, None)

    def parsed(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """A whole answer as (content, calls): what a model says before the calls it chose stays its
        content; a text without calls is all content."""
        if self.tool_call_syntax is not None:
            content, calls = self.tool_call_syntax.parse(text)
            if calls:
                return content, calls if self.parallel_tool_calls else calls[:1]
        return text, None

    def finish_reason(self, finish_reason: str | None, calls: list[dict[str, Any]] | None) -> str | None:
        """"tool_calls" for calls the model chose ("required", "auto"), as vLLM says it; a named
        function's calls end as their text did ("stop"), as OpenAI's forced calls do."""
        return "tool_calls" if finish_reason == "stop" and calls and not self.is_named else finish_reason
