"""Reading tool calls out of a model's text, whole or as far as they are written: JSON call
objects (`{"name": ..., "arguments": {...}}`, or Llama's `"parameters"`), lists and runs of them,
and Python call lists (`[f(x=1), g()]`). A call's `arguments` are kept as the model's own JSON text.
The syntaxes of tool_parsers.py's registry find where calls are; this reads them."""
from __future__ import annotations

import ast
import json
import re
from typing import Any

from services.gateway.tool_calls import tool_call

Calls = list[dict[str, Any]]

_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(arguments|parameters)"\s*:\s*')


def parse_call(body: str, arguments_key: str) -> dict[str, Any] | None:
    """One call in OpenAI's shape from its JSON text; None when it is not one. Arguments written as
    an object (or list) are that JSON text as the model wrote it, as its stream sent it."""
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    header = _HEADER.match(body)
    if header is not None and body[header.end()] in "{[":
        return tool_call(parsed["name"], body[header.end():json_end(body, header.end(), {})])
    return tool_call(parsed["name"], arguments_json(parsed.get(arguments_key, parsed.get("arguments", {}))))


def begun_tag_length(text: str, tag: str) -> int:
    """How many of `text`'s last characters could be the start of `tag` (held back while streaming,
    until the next delta says)."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:n])), 0)


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def arguments_json(value: Any) -> str:
    """A call's arguments as OpenAI's JSON text: a string as it is (JSON already), else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def call_so_far(text: str, start: int, end: int, scans: dict[int, JsonScan]) -> tuple[str, str] | None:
    """(name, arguments' text so far) of a call object begun at `text[start:end]`, if it streams: its
    name comes first, and is whole. A value other than an object or a list comes whole at the end."""
    header = _HEADER.match(text, start, end)
    if header is None:
        return None
    try:
        name = json.loads(header.group(1))
    except json.JSONDecodeError:  # an escape cut short, say
        return None
    at = header.end()
    if at == end or text[at] not in "{[":
        return name, ""
    value_end = json_end(text, at, scans)
    return name, text[at:end if value_end is None else min(value_end, end)]


class JsonScan:
    """How far a JSON object or list opening at `start` of a growing text has been read."""

    _OUTSIDE, _INSIDE = re.compile(r'["{}\[\]]'), re.compile(r'["\\]')  # what changes the state

    def __init__(self, start: int) -> None:
        self.at = start
        self.depth = 0
        self.in_string = False
        self.end: int | None = None  # just past its last bracket, once read

    def read(self, text: str) -> int | None:
        """Where the value ends in `text` (this scan's text so far, and more), or None if it does not yet."""
        while self.end is None:
            found = (self._INSIDE if self.in_string else self._OUTSIDE).search(text, self.at)
            if found is None:
                self.at = len(text)
                return None
            char, at = found.group(), found.start()
            if char == "\\":
                if at + 1 == len(text):  # its escaped character is still to come
                    self.at = at
                    return None
                self.at = at + 2
                continue
            self.at = at + 1
            if char == '"':
                self.in_string = not self.in_string
            elif char in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    self.end = self.at
        return self.end


def json_end(text: str, start: int, scans: dict[int, JsonScan]) -> int | None:
    """Where the JSON object or list opening at `text[start]` ends (just past its last bracket);
    None if it does not end in `text`. `scans`: those begun on earlier, shorter versions of `text`."""
    scan = scans.get(start)
    if scan is None:
        scan = scans[start] = JsonScan(start)
    return scan.read(text)


SEPARATORS = "; \n\t"  # between llama3_json's calls
LISTED = ", \n\t"  # between the calls of a JSON list
BLANK = " \n\t\r"


def past(text: str, at: int, skipped: str) -> int:
    while at < len(text) and text[at] in skipped:
        at += 1
    return at


def listed_calls(body: str, arguments_key: str) -> Calls | None:
    """The calls of `body`, a JSON list of call objects, each in OpenAI's shape; None if it is not one."""
    try:
        listed = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(listed, list) or not body.startswith("["):
        return None
    calls, at, scans = [], past(body, 1, BLANK), {}
    while at < len(body) and body[at] == "{":
        end = json_end(body, at, scans)
        call = parse_call(body[at:end], arguments_key)
        if call is None:
            return None
        calls.append(call)
        at = past(body, end, LISTED)
    return calls if len(calls) == len(listed) else None


def objects_so_far(text: str, at: int, separators: str, scans: dict[int, JsonScan]) -> list[tuple[str, str]]:
    """`progress` of call objects from `text[at:]` on, one after another with `separators` between."""
    begun, at = [], past(text, at, separators)
    while at < len(text) and text[at] == "{":
        end = json_end(text, at, scans)
        call = call_so_far(text, at, len(text) if end is None else end, scans)
        if call is None:
            break
        begun.append(call)
        if end is None:
            break
        at = past(text, end, separators)
    return begun


def after_last_closed_call(text: str) -> int | None:
    """Where the last call closed directly inside a Python list `text` opens (just past its `)`), strings
    and nesting skipped; None before the first one closes."""
    depth, quote, at, end = 0, None, 0, None
    while at < len(text):
        char = text[at]
        if quote is not None:
            if char == "\\":
                at += 2
                continue
            if text.startswith(quote, at):
                at, quote = at + len(quote), None
                continue
        elif char in "'\"":
            quote = text[at:at + 3] if text[at:at + 3] in ("'''", '"""') else char
            at += len(quote)
            continue
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 1 and char == ")":
                end = at + 1
        at += 1
    return end


def pythonic_call(node: ast.expr) -> dict[str, Any] | None:
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
