"""A chat reply's tool calls as they stream: text until a call starts, then each call's id and name
once whole and its arguments as they are written (tool_parsers.py's module docstring tells the
rules), and how two deltas of calls merge."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.gateway.call_text import Calls, JsonScan
from services.gateway.tool_calls import tool_call
from services.gateway.tool_parsers import ToolCallSyntax


@dataclass
class StreamedCalls:
    """One choice's stream through `syntax`: `add` each text delta, `finish` at the end. Each gives the
    text to send and the tool-call deltas to send (OpenAI's stream shape: a call's first one has its
    `index`, `id`, `type` and name, the next ones more of its arguments)."""

    syntax: ToolCallSyntax
    _held: str = ""  # text not sent yet: a possible start of a call, or everything from one on
    _in_calls: bool = False
    _sent_any: bool = False
    _begun: list[list] = field(default_factory=list)  # per call sent: [its id, how much of its arguments went]
    # What `progress` scanned of the held text so far: each delta's scan goes on from there, so a
    # long call costs its length once, not once per delta.
    _scans: dict[int, JsonScan] = field(default_factory=dict)
    calls: Calls = field(default_factory=list)  # once finished: the calls made, whole

    def add(self, delta: str) -> tuple[str, Calls]:
        if self._in_calls:
            self._held += delta
            return "", self._call_deltas()
        text = self._held + delta
        at_start = not self._sent_any
        start = self.syntax.call_start(text, at_start)
        if start is not None:
            self._in_calls, self._held = True, text[start:]
            return self._sent(text[:start]), self._call_deltas()
        keep = self.syntax.held_back(text, at_start)
        self._held = text[len(text) - keep:]
        return self._sent(text[:len(text) - keep]), []

    def finish(self) -> tuple[str, Calls]:
        """The rest; `calls` then holds the calls made."""
        held, self._held = self._held, ""
        if not self._in_calls:
            return held, []
        content, calls = self.syntax.parse(held)
        if not calls:
            if not self._begun:
                return content or "", []
            # Broken after some went out: they stay as far as they got.
            calls = [tool_call(name, arguments, self.syntax.call_id())
                     for name, arguments in self.syntax.progress(held, self._scans)]
        deltas = []
        for index, call in enumerate(calls):
            if index < len(self._begun):
                call["id"], num_sent = self._begun[index]
                rest = call["function"]["arguments"][num_sent:]
                if rest:
                    deltas.append({"index": index, "function": {"arguments": rest}})
            else:
                deltas.append({"index": index, **call})
        self.calls = calls
        return "", deltas

    def _call_deltas(self) -> Calls:
        deltas = []
        for index, (name, arguments) in enumerate(self.syntax.progress(self._held, self._scans)):
            if index == len(self._begun):
                call = tool_call(name, arguments, self.syntax.call_id())
                self._begun.append([call["id"], len(arguments)])
                deltas.append({"index": index, **call})
            elif len(arguments) > self._begun[index][1]:
                deltas.append({"index": index, "function": {"arguments": arguments[self._begun[index][1]:]}})
                self._begun[index][1] = len(arguments)
        return deltas

    def _sent(self, text: str) -> str:
        self._sent_any = self._sent_any or bool(text)
        return text


def merged_call_deltas(first: Calls, then: Calls) -> Calls:
    """Two lists of tool-call deltas as one chunk's: one delta per call, its arguments joined."""
    merged: dict[int, dict[str, Any]] = {}
    for delta in [*first, *then]:
        into = merged.get(delta["index"])
        if into is None:
            merged[delta["index"]] = {**delta, "function": dict(delta["function"])}
        else:
            into["function"]["arguments"] = into["function"].get("arguments", "") + delta["function"]["arguments"]
    return list(merged.values())


# A call object that opens with its name and then its arguments, as models write them: what
# streams. Its arguments are the model's JSON text of them, from the value's first character.
