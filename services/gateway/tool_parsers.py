"""Tool calls a model chose to make (`tool_choice: "auto"`), read out of its text.

Models write calls in their own syntax; `--tool-call-parser` names the one the served model
uses. `hermes` (Qwen2.5 and Qwen3, Hermes, many fine-tunes): each call a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, after any text
the model says first. A text whose calls are not whole JSON is answered as text, as vLLM's
parser does.

Streaming: text goes out as it comes until a call starts; what could be the start of
`<tool_call>` is held back until the next delta says, as stop strings are; from the first
call on, the rest is held and its calls are sent at the end, parsed whole.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from services.gateway.tool_calls import new_call_id

PARSERS = ("hermes",)
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_START) + r"\s*(.*?)\s*(?:" + re.escape(CALL_END) + r"|$)", re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(the text before the calls, or None when there is none; the calls, OpenAI's shape)."""
    start = text.find(CALL_START)
    if start == -1:
        return text, []
    calls = []
    for body in _CALL.findall(text, start):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        arguments = call.get("arguments", {})
        calls.append({"id": new_call_id(), "type": "function", "function": {
            "name": call["name"],
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)}})
    content = text[:start].strip()
    return content or None, calls


@dataclass
class StreamedCalls:
    """One choice's stream through the parser: `add` each text delta, `finish` at the end."""

    _held: str = ""  # text not sent yet: a possible start of a call, or everything from one on
    _in_calls: bool = False
    calls: list[dict[str, Any]] = field(default_factory=list)

    def add(self, delta: str) -> str:
        """The text to send now."""
        if self._in_calls:
            self._held += delta
            return ""
        text = self._held + delta
        start = text.find(CALL_START)
        if start != -1:
            self._in_calls, self._held = True, text[start:]
            return text[:start]
        keep = next((n for n in range(min(len(CALL_START) - 1, len(text)), 0, -1)
                     if text.endswith(CALL_START[:n])), 0)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def finish(self) -> str:
        """The text still to send; `calls` holds the calls, if the held text made whole ones."""
        held, self._held = self._held, ""
        if not self._in_calls:
            return held
        content, self.calls = parse_hermes(held)
        return "" if self.calls else (content or "")
