"""Tool calls a model chose to make (`tool_choice: "auto"`), read out of its text.

Models write calls in their own syntax; `--tool-call-parser` names the one the served model
uses:
- `hermes` (Qwen2.5 and Qwen3, Hermes, many fine-tunes): each call a JSON object
  `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, after any
  text the model says first;
- `llama3_json` (Llama 3.1 to 3.3): the whole answer is the calls, JSON objects
  `{"name": ..., "parameters": {...}}` separated by `;` (after `<|python_tag|>`, a special
  token the text leaves out);
- `pythonic` (Llama 3.2 and 4, and models tuned to it): the whole answer is a Python list of
  calls with keyword arguments, `[get_weather(city="Paris"), get_time()]`, their values Python
  literals (after `<|python_start|>`, a special token, for Llama 4).
A text whose calls are not whole JSON is answered as text, as vLLM's parsers do.

Streaming: text goes out as it comes until a call starts; what could be the start of one is
held back until the next delta says, as stop strings are; from the first call on, the rest
is held and its calls are sent at the end, parsed whole.
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.gateway.errors import APIError
from services.gateway.tool_calls import tool_call

Calls = list[dict[str, Any]]


class ToolCallSyntax(Protocol):
    def parse(self, text: str) -> tuple[str | None, Calls]:
        """(the text before the calls, None when there is none; the calls, OpenAI's shape)."""

    def call_start(self, text: str, at_start: bool) -> int | None:
        """Where in `text` calls begin, if they do; `at_start`: nothing was sent before it."""

    def held_back(self, text: str, at_start: bool) -> int:
        """How many of `text`'s last characters could still turn out to begin a call."""


class Hermes:
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(re.escape(START) + r"\s*(.*?)\s*(?:" + re.escape(END) + r"|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, Calls]:
        start = text.find(self.START)
        if start == -1:
            return text, []
        calls = []
        for body in self._CALL.findall(text, start):
            call = _call(body, "arguments")
            if call is None:
                return text, []
            calls.append(call)
        return text[:start].strip() or None, calls

    def call_start(self, text: str, at_start: bool) -> int | None:
        start = text.find(self.START)
        return None if start == -1 else start

    def held_back(self, text: str, at_start: bool) -> int:
        return next((n for n in range(min(len(self.START) - 1, len(text)), 0, -1)
                     if text.endswith(self.START[:n])), 0)


class _CallsOnly:
    """A syntax whose answer is calls alone, from its first character (`OPEN`) on, or text."""

    OPEN = ""

    def call_start(self, text: str, at_start: bool) -> int | None:
        stripped = text.lstrip()
        return len(text) - len(stripped) if at_start and stripped.startswith(self.OPEN) else None

    def held_back(self, text: str, at_start: bool) -> int:
        return len(text) if at_start and not text.strip() else 0  # blank so far: a call may still come


class Llama3Json(_CallsOnly):
    OPEN = "{"

    def parse(self, text: str) -> tuple[str | None, Calls]:
        body = text.strip()
        if not body.startswith(self.OPEN):
            return text, []
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                value, end = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return text, []
            call = _call(value, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            at = end
            while at < len(body) and body[at] in "; \n\t":
                at += 1
        return None, calls


class Pythonic(_CallsOnly):
    OPEN = "["

    def parse(self, text: str) -> tuple[str | None, Calls]:
        body = text.strip()
        if not body.startswith(self.OPEN):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            return text, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            call = _pythonic_call(node)
            if call is None:
                return text, []
            calls.append(call)
        return None, calls


PARSERS: dict[str, ToolCallSyntax] = {"hermes": Hermes(), "llama3_json": Llama3Json(), "pythonic": Pythonic()}


def needs_a_parser(param: str) -> APIError:
    """The refusal of tool_choice "auto" by a gateway started without a parser, as vLLM refuses it
    without `--enable-auto-tool-choice`."""
    return APIError(400, 'tool_choice "auto" (the default with tools) needs the gateway started with '
                         '--tool-call-parser, to read the model\'s own calls: use "required", a named function '
                         'or "none"', param=param)


@dataclass
class StreamedCalls:
    """One choice's stream through `syntax`: `add` each text delta, `finish` at the end."""

    syntax: ToolCallSyntax
    _held: str = ""  # text not sent yet: a possible start of a call, or everything from one on
    _in_calls: bool = False
    _sent_any: bool = False
    calls: Calls = field(default_factory=list)

    def add(self, delta: str) -> str:
        """The text to send now."""
        if self._in_calls:
            self._held += delta
            return ""
        text = self._held + delta
        at_start = not self._sent_any
        start = self.syntax.call_start(text, at_start)
        if start is not None:
            self._in_calls, self._held = True, text[start:]
            return self._sent(text[:start])
        keep = self.syntax.held_back(text, at_start)
        self._held = text[len(text) - keep:]
        return self._sent(text[:len(text) - keep])

    def finish(self) -> str:
        """The text still to send; `calls` holds the calls, if the held text made whole ones."""
        held, self._held = self._held, ""
        if not self._in_calls:
            return held
        content, self.calls = self.syntax.parse(held)
        return "" if self.calls else (content or "")

    def _sent(self, text: str) -> str:
        self._sent_any = self._sent_any or bool(text)
        return text


def _call(body: str | Any, arguments_key: str) -> dict[str, Any] | None:
    """One call in OpenAI's shape from its JSON (text or parsed); None when it is not one."""
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except json.JSONDecodeError:
            return None
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None
    arguments = body.get(arguments_key, body.get("arguments", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return tool_call(body["name"], arguments)


def _pythonic_call(node: ast.expr) -> dict[str, Any] | None:
    """`name(key=literal, ...)` in OpenAI's shape; None for anything else (positional arguments,
    `**kwargs`, a value that is not a literal)."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except ValueError:
            return None
    try:
        return tool_call(node.func.id, json.dumps(arguments, ensure_ascii=False))
    except TypeError:  # a literal JSON has no word for: a set, bytes, a complex number
        return None
