"""Tool calls written as tags around each argument, typed by the request's tool schemas, read as
vLLM's parsers read them.

`qwen3_coder`: Qwen3-Coder's XML (also Qwen3-Next's and Qwen3.5's):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

after any text the model says first. A parameter's value is raw text (one newline at each end
dropped), turned into JSON by the type the request's tool gives that parameter: strings stay
text; integers, numbers and booleans are parsed, `null` is null; objects and arrays are parsed as
JSON, else as Python literals; a value that does not parse, or a parameter the tool does not
declare, stays text.

`seed_oss` (Seed-OSS): the same calls between `<seed:tool_call>` and `</seed:tool_call>`.

`minimax_m2` (MiniMax-M2): `<minimax:tool_call>`, then `<invoke name="NAME">` and a
`<parameter name="KEY">VALUE</parameter>` per argument, typed as Qwen3-Coder's are, `</invoke>`
and `</minimax:tool_call>`.

`glm45` (GLM-4.5, 4.6 and 4.7): `<tool_call>NAME` then `<arg_key>KEY</arg_key>` and
`<arg_value>VALUE</arg_value>` pairs, then `</tool_call>`, with or without newlines between. A
value (stripped) stays text where its tool declares a string; any other is parsed as JSON, else as
a Python literal, else stays text.

Streaming, both: a call's id and name go out once its name is whole, its arguments whole once the
call is closed (they are JSON only then).
"""
from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from typing import Any

from services.gateway.call_text import Calls, JsonScan, begun_tag_length
from services.gateway.tool_calls import new_call_id, tool_call

START, FUNCTION = "<tool_call>", "<function="
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)
_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}
_INTEGER_TYPES = {"integer", "int", "uint", "long", "short", "unsigned"}
_NUMBER_TYPES = {"number", "float", "double", "num"}
_BOOLEAN_TYPES = {"boolean", "bool", "binary"}


class _ArgumentsByTag:
    """A syntax whose calls hold each argument between tags of its own, typed by the request's tools."""

    reads_special_tokens = False
    call_id = staticmethod(new_call_id)

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self._properties = _properties_by_function(tools)

    @staticmethod
    def template_call_id(call_id: str) -> str:
        return call_id

    def parse(self, text: str) -> tuple[str | None, Calls]:
        start = self.call_start(text, True)
        if start is None:
            return text, []
        calls = []
        for name, body, is_closed in self._calls(text[start:]):
            if name is None or not is_closed:
                return text, []  # nameless, or cut short: answered as text, as a broken JSON call is
            calls.append(tool_call(name, self._arguments(name, body)))
        if not calls:
            return text, []
        return text[:start].strip() or None, calls

    def progress(self, text: str, scans: dict[int, JsonScan]) -> list[tuple[str, str]]:
        begun = []
        for name, body, is_closed in self._calls(text):
            if name is None:
                break
            begun.append((name, self._arguments(name, body) if is_closed else ""))
            if not is_closed:
                break
        return begun

    def _arguments(self, function: str, body: str) -> str:
        properties = self._properties.get(function, {})
        arguments = {}
        for key, value in self._pairs(body):
            schema = properties.get(key)
            arguments[key] = self._typed(value, schema.get("type") if isinstance(schema, dict) else None)
        return json.dumps(arguments, ensure_ascii=False)

    def call_start(self, text: str, at_start: bool) -> int | None:
        raise NotImplementedError

    def _calls(self, text: str) -> Iterator[tuple[str | None, str, bool]]:
        """Each call in `text`: its name (None until it is whole), its arguments' text, whether it is closed."""
        raise NotImplementedError

    def _pairs(self, body: str) -> Iterator[tuple[str, str]]:
        raise NotImplementedError

    def _typed(self, value: str, declared: Any) -> Any:
        raise NotImplementedError


class Qwen3Coder(_ArgumentsByTag):
    start = START

    def call_start(self, text: str, at_start: bool) -> int | None:
        starts = [at for at in (text.find(self.start), text.find(FUNCTION)) if at != -1]
        return min(starts) if starts else None

    def held_back(self, text: str, at_start: bool) -> int:
        return max(begun_tag_length(text, self.start), begun_tag_length(text, FUNCTION))

    def _calls(self, text: str) -> Iterator[tuple[str | None, str, bool]]:
        for match in _FUNCTION.finditer(text):
            is_named = match.group(0).startswith(f"<function={match[1]}>")
            yield (match[1].strip() if is_named else None), match[2], match.group(0).endswith("</function>")

    def _pairs(self, body: str) -> Iterator[tuple[str, str]]:
        for name, value in _PARAMETER.findall(body):
            yield name.strip(), value.removeprefix("\n").removesuffix("\n")

    def _typed(self, value: str, declared: Any) -> Any:
        return _converted(value, declared)


class SeedOss(Qwen3Coder):
    start = "<seed:tool_call>"


class MiniMaxM2(_ArgumentsByTag):
    START = "<minimax:tool_call>"
    _INVOKE = re.compile(r'<invoke name=(?:"([^"\n]*)"|([^">\n]*))>(.*?)(?:</invoke>|$)', re.DOTALL)
    _PARAMETER = re.compile(r'<parameter name=(?:"([^"\n]*)"|([^">\n]*))>(.*?)(?:</parameter>|$)', re.DOTALL)

    def call_start(self, text: str, at_start: bool) -> int | None:
        start = text.find(self.START)
        return None if start == -1 else start

    def held_back(self, text: str, at_start: bool) -> int:
        return begun_tag_length(text, self.START)

    def _calls(self, text: str) -> Iterator[tuple[str | None, str, bool]]:
        for match in self._INVOKE.finditer(text):
            name = (match[1] if match[1] is not None else match[2]).strip()
            yield name or None, match[3], match.group(0).endswith("</invoke>")

    def _pairs(self, body: str) -> Iterator[tuple[str, str]]:
        for quoted, bare, value in self._PARAMETER.findall(body):
            yield (quoted or bare).strip(), value.removeprefix("\n").removesuffix("\n")

    def _typed(self, value: str, declared: Any) -> Any:
        return _converted(value, declared)


class Glm45(_ArgumentsByTag):
    _CALL = re.compile(r"<tool_call>(.*?)(<arg_key>.*?)?(</tool_call>|$)", re.DOTALL)
    _ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>(?:\\n|\s)*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def call_start(self, text: str, at_start: bool) -> int | None:
        start = text.find(START)
        return None if start == -1 else start

    def held_back(self, text: str, at_start: bool) -> int:
        return begun_tag_length(text, START)

    def _calls(self, text: str) -> Iterator[tuple[str | None, str, bool]]:
        for match in self._CALL.finditer(text):
            name, is_closed = match[1].strip(), bool(match[3])
            is_named = bool(name) and (is_closed or bool(match[2]))  # whole at its first key, or the end
            yield (name if is_named else None), match[2] or "", is_closed

    def _pairs(self, body: str) -> Iterator[tuple[str, str]]:
        for key, value in self._ARGUMENT.findall(body):
            yield key.strip(), value.strip()

    def _typed(self, value: str, declared: Any) -> Any:
        return value if declared == "string" else _parsed(value)


def _converted(value: str, declared: Any) -> Any:
    """`value` as the JSON its declared type makes of it; text where it does not parse so."""
    kinds = {str(kind).strip().lower() for kind in (declared if isinstance(declared, list) else [declared])
             if kind is not None}
    if not kinds or kinds & _STRING_TYPES:
        return value
    if value.strip().lower() == "null":
        return None
    text = value.strip()
    if kinds & _INTEGER_TYPES:
        try:
            return int(text)
        except ValueError:
            pass
    if kinds & (_NUMBER_TYPES | _INTEGER_TYPES):
        try:
            number = float(text)
        except ValueError:
            return value
        return int(number) if number.is_integer() and not any(c in text for c in ".eE") else number
    if kinds & _BOOLEAN_TYPES:
        return text.lower() == "true" if text.lower() in ("true", "false") else value
    parsed = _parsed(text)  # objects, arrays and any other declared type
    return value if parsed is text else parsed


def _properties_by_function(tools: list[dict[str, Any]] | None) -> dict[str, dict]:
    """function name → its parameters' JSON schema properties."""
    properties = {}
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            declared = parameters.get("properties") if isinstance(parameters, dict) else None
            properties[function["name"]] = declared if isinstance(declared, dict) else {}
    return properties


def _parsed(text: str) -> Any:
    """`text` as JSON, else as a Python literal JSON can hold, else as it is."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        literal = ast.literal_eval(text)
        json.dumps(literal)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text
    return literal
