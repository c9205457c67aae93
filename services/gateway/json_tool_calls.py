"""Tool calls written in a model's plain text as JSON call objects, or as a Python list of calls,
read as vLLM's parsers read them: `hermes`, `llama3_json`, `pythonic`, `granite` and
`phi4_mini_json` (tool_parsers.py tells each one's syntax and how it streams), and tool_choice
"required"'s guided list of calls (RequiredCalls). Each class here finds where its calls are;
call_text.py reads them."""
from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable

from services.gateway.call_text import (
    BLANK,
    LISTED,
    SEPARATORS,
    Calls,
    JsonScan,
    after_last_closed_call,
    begun_tag_length,
    call_so_far,
    listed_calls,
    objects_so_far,
    parse_call,
    past,
    pythonic_call,
)
from services.gateway.tool_calls import new_call_id


class _Syntax:
    reads_special_tokens = False
    call_id = staticmethod(new_call_id)

    @staticmethod
    def template_call_id(call_id: str) -> str:
        return call_id


class _Tagged(_Syntax):
    """A syntax whose calls begin at a tag (`START`), wherever it comes."""

    START = ""

    def call_start(self, text: str, at_start: bool) -> int | None:
        start = text.find(self.START)
        return None if start == -1 else start

    def held_back(self, text: str, at_start: bool) -> int:
        return begun_tag_length(text, self.START)


class Hermes(_Tagged):
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(re.escape(START) + r"\s*(.*?)\s*(?:" + re.escape(END) + r"|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, Calls]:
        start = text.find(self.START)
        if start == -1:
            return text, []
        calls = []
        for body in self._CALL.findall(text, start):
            call = parse_call(body, "arguments")
            if call is None:
                return text, []
            calls.append(call)
        return text[:start].strip() or None, calls

    def progress(self, text: str, scans: dict[int, JsonScan]) -> list[tuple[str, str]]:
        begun, at = [], text.find(self.START)
        while at != -1:
            at += len(self.START)
            end = text.find(self.END, at)
            call = call_so_far(text, at, len(text) if end == -1 else end, scans)
            if call is None:
                break
            begun.append(call)
            if end == -1:
                break
            at = text.find(self.START, end)
        return begun


class _CallsOnly(_Syntax):
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
                _, end = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return text, []
            call = parse_call(body[at:end], "parameters")
            if call is None:
                return text, []
            calls.append(call)
            at = past(body, end, SEPARATORS)
        return None, calls

    def progress(self, text: str, scans: dict[int, JsonScan]) -> list[tuple[str, str]]:
        return objects_so_far(text, 0, SEPARATORS, scans)


class Pythonic(_CallsOnly):
    OPEN = "["

    def progress(self, text: str, scans: dict[int, JsonScan]) -> list[tuple[str, str]]:
        """The calls closed so far, each whole: a Python call's arguments are JSON only once it is
        parsed, so a call goes out when its `)` is written, not piece by piece."""
        end = after_last_closed_call(text)
        if end is None:
            return []
        _, calls = self.parse(text[:end] + "]")
        return [(call["function"]["name"], call["function"]["arguments"]) for call in calls]

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
            call = pythonic_call(node)
            if call is None:
                return text, []
            calls.append(call)
        return None, calls


class Granite(_CallsOnly):
    """Granite 3.x: the whole answer is a JSON list of `{"name", "arguments"}` calls, after Granite
    3.0's `<|tool_call|>` (a special token the text leaves out) or 3.1's `<tool_call>` text."""

    OPEN, TAG = "[", "<tool_call>"

    def call_start(self, text: str, at_start: bool) -> int | None:
        stripped = text.lstrip()
        if not at_start or not stripped.startswith((self.OPEN, self.TAG)):
            return None
        return len(text) - len(stripped)

    def held_back(self, text: str, at_start: bool) -> int:
        stripped = text.strip()
        return len(text) if at_start and self.TAG.startswith(stripped) else 0  # blank, or "<tool_c" so far

    def parse(self, text: str) -> tuple[str | None, Calls]:
        calls = listed_calls(text.strip().removeprefix(self.TAG).strip(), "arguments")
        return (None, calls) if calls else (text, [])

    def progress(self, text: str, scans: dict[int, JsonScan]) -> list[tuple[str, str]]:
        at = past(text, len(self.TAG), BLANK) if text.startswith(self.TAG) else 0
        if at == len(text) or text[at] != self.OPEN:
            return []
        return objects_so_far(text, at + 1, LISTED, scans)


class Phi4MiniJson(_Tagged):
    """Phi-4-mini: `functools` and a JSON list of `{"name", "arguments"}` calls (or `"parameters"`),
    after any text the model says first."""

    START = "functools["

    def parse(self, text: str) -> tuple[str | None, Calls]:
        start = text.find(self.START)
        if start == -1:
            return text, []
        calls = listed_calls(text[start + len(self.START) - 1:].strip(), "parameters")
        return (text[:start].strip() or None, calls) if calls else (text, [])

    def progress(self, text: str, scans: dict[int, JsonScan]) -> list[tuple[str, str]]:
        return objects_so_far(text, past(text, len(self.START), BLANK), LISTED, scans)


class RequiredCalls(_CallsOnly):
    """tool_choice "required": the text guided to a JSON list of `{"name", "parameters"}` calls of the
    request's tools (tool_calls.ForcedToolCall), read and streamed as a parser reads a model's own.
    `call_id`: where its calls' ids come from (the gateway's parser's kind)."""

    OPEN = "["

    def __init__(self, call_id: Callable[[], str] = new_call_id) -> None:
        self.call_id = call_id

    def parse(self, text: str) -> tuple[str | None, Calls]:
        calls = listed_calls(text.strip(), "parameters")
        if not calls:
            return text, []
        for call in calls:
            call["id"] = self.call_id()
        return None, calls

    def progress(self, text: str, scans: dict[int, JsonScan]) -> list[tuple[str, str]]:
        return objects_so_far(text, 1, LISTED, scans)
