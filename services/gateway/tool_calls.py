"""Forced tool calls for chat: `tool_choice` naming a function, or `"required"`, as vLLM serves
them without a tool-call parser. The text is guided (engine/guided_decoding.py) to the named
function's arguments, or to a JSON list of `{"name", "parameters"}` calls of the request's
tools, and the response carries it as `tool_calls` instead of content. `"none"` lists the
tools to the model (its chat template shows them) and returns plain text. `"auto"` (the
default when tools are given) lets the model choose, which needs a parser of its own
tool-call syntax (tool_parsers.py, `--tool-call-parser`): without one the gateway refuses it,
as vLLM does without `--enable-auto-tool-choice`.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from services.gateway.structured_output import ANY_JSON_OBJECT, OutputGuide, schema_guide


class BadToolError(ValueError):
    """A tool of the request's list that is not a function tool as OpenAI's API writes one."""


@dataclass(frozen=True)
class ForcedToolCall:
    """`name`: the function every answer calls; None for "required", any of `tools`, one or more
    (one only with `one_call`: parallel_tool_calls false, the list guided to end after its first)."""

    name: str | None
    tools: tuple[dict[str, Any], ...]
    one_call: bool = False

    @property
    def guide(self) -> OutputGuide:
        return schema_guide(self._schema())

    def named_call(self, text: str, call_id: str) -> dict[str, Any] | None:
        """The named function's call the guided text makes, its arguments as the model wrote them
        (what its stream sent); None when they are not whole JSON (cut short by max_tokens).
        "required"'s list of calls is read as a parser reads the model's own (json_tool_calls.RequiredCalls)."""
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return None
        return tool_call(self.name, text, call_id)

    def _schema(self) -> dict[str, Any]:
        if self.name is not None:
            return _parameters(next(t for t in self.tools if t["function"]["name"] == self.name))
        return {"type": "array", "minItems": 1, **({"maxItems": 1} if self.one_call else {}), "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                              "parameters": _parameters(t)}, "required": ["name", "parameters"]}
            for t in self.tools]}}


def forced_tool_call(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
                     parallel_tool_calls: bool = True) -> ForcedToolCall | None:
    """What `tool_choice` forces, given `tools`; None for plain text or the model's own choice
    ("auto"). ValueError, worded for the client, for a choice that cannot be served."""
    for i, tool in enumerate(tools or ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function" \
                or not isinstance(function.get("name"), str):
            raise BadToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        if not isinstance(function.get("parameters"), dict | None):
            raise BadToolError(f"tools[{i}].function.parameters must be a JSON schema object")
    choice = effective_tool_choice(tools, tool_choice)
    if choice == "none":
        return None
    if not tools:
        raise ValueError("tool_choice needs tools to choose from")
    if choice == "auto":
        return None
    if choice == "required":
        return ForcedToolCall(None, tuple(tools), one_call=not parallel_tool_calls)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                         '"function": {"name": ...}}')
    if name not in {t["function"]["name"] for t in tools}:
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    return ForcedToolCall(name, tuple(tools))


def effective_tool_choice(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None
                          ) -> str | dict[str, Any]:
    """OpenAI's default: "auto" when there are tools, "none" when there are not."""
    return tool_choice if tool_choice is not None else ("auto" if tools else "none")


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    """One call as OpenAI's message lists it; `arguments`: JSON text; by default a new id."""
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or ANY_JSON_OBJECT
