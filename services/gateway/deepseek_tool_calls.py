"""Tool calls in DeepSeek's syntax, read as vLLM's parsers read them: after any text the model says
first, `<｜tool▁calls▁begin｜>`, then each call between `<｜tool▁call▁begin｜>` and
`<｜tool▁call▁end｜>`, then `<｜tool▁calls▁end｜>`. Inside a call:

- `deepseek_v3` (DeepSeek-V3, R1-0528): `function<｜tool▁sep｜>NAME`, a newline, and the arguments'
  JSON in a ```json fence;
- `deepseek_v31` (V3.1, V3.2): `NAME<｜tool▁sep｜>` and the arguments' JSON.

The arguments are the model's JSON text, as written. The markers are special tokens, so requests
read for calls keep special tokens in their text (as vLLM's parsers ask). Streaming: a call's id and
name go out once its name is whole, its arguments once the call ends.
"""
from __future__ import annotations

import json
import re

from services.gateway.call_text import Calls, JsonScan
from services.gateway.tool_calls import new_call_id, tool_call

CALLS_BEGIN, CALL_BEGIN = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"
CALL_END, SEP = "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


class _DeepSeekCalls:
    reads_special_tokens = True
    call_id = staticmethod(new_call_id)
    # A call begun: its name (group "name"), its arguments' JSON (group "arguments", once whole).
    CALL: re.Pattern
    NAMED: re.Pattern  # a call's beginning once its name is whole

    @staticmethod
    def template_call_id(call_id: str) -> str:
        return call_id

    def call_start(self, text: str, at_start: bool) -> int | None:
        start = text.find(CALLS_BEGIN)
        return None if start == -1 else start

    def held_back(self, text: str, at_start: bool) -> int:
        return next((n for n in range(min(len(CALLS_BEGIN) - 1, len(text)), 0, -1)
                     if text.endswith(CALLS_BEGIN[:n])), 0)

    def parse(self, text: str) -> tuple[str | None, Calls]:
        start = text.find(CALLS_BEGIN)
        if start == -1:
            return text, []
        calls = []
        for piece in text[start:].split(CALL_BEGIN)[1:]:
            match = self.CALL.fullmatch(piece.split(CALL_END)[0]) if CALL_END in piece else None
            if match is None or not _is_json(match["arguments"]):
                return text, []  # cut short or malformed: answered as text, as vLLM's parsers do
            calls.append(tool_call(match["name"].strip(), match["arguments"].strip()))
        if not calls:
            return text, []
        return text[:start].strip() or None, calls

    def progress(self, text: str, scans: dict[int, JsonScan]) -> list[tuple[str, str]]:
        begun = []
        for piece in text.split(CALL_BEGIN)[1:]:
            is_closed = CALL_END in piece
            body = piece.split(CALL_END)[0]
            whole = self.CALL.fullmatch(body) if is_closed else None
            named = whole or self.NAMED.match(body)
            if named is None:
                break
            begun.append((named["name"].strip(), whole["arguments"].strip() if whole else ""))
            if not is_closed:
                break
        return begun


class DeepSeekV3(_DeepSeekCalls):
    CALL = re.compile(r"(?P<type>[^<]*)" + re.escape(SEP) + r"(?P<name>[^\n]*)\n```json\n(?P<arguments>.*)\n```\s*",
                      re.DOTALL)
    NAMED = re.compile(r"[^<]*" + re.escape(SEP) + r"(?P<name>[^\n]+)\n")


class DeepSeekV31(_DeepSeekCalls):
    CALL = re.compile(r"(?P<name>[^<]*)" + re.escape(SEP) + r"(?P<arguments>.*)", re.DOTALL)
    NAMED = re.compile(r"(?P<name>[^<]+)" + re.escape(SEP))


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True
