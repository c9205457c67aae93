"""gpt-oss replies in OpenAI's harmony format, read into thinking, answer and tool calls
(`--reasoning-parser openai_gptoss`, `--tool-call-parser openai`, as vLLM names them).

A harmony reply is a run of messages, each a header and a body: after the prompt's
`<|start|>assistant`, `<|channel|>analysis<|message|>` and the thinking, `<|end|>`, then
`<|start|>assistant<|channel|>final<|message|>` and the answer, ended by `<|return|>`. A call is a
message to a recipient: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`
and its arguments' JSON, ended by `<|call|>` (the recipient may also follow the role:
`<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>`). The markers are
special tokens, so requests read this way keep special tokens in their text.

Read as vLLM reads them: the `analysis` channel is thinking; `final`, and `commentary` with no
recipient (a preamble the model means the user to see), are the answer; a message to
`functions.NAME` is a call of NAME. A message to another recipient (the built-in `browser` or
`python` tools, which this server does not run) is thinking, the model's working. A reply that
opens with no header at all (a guided one: the guide holds from its first token) is all answer.

`HarmonyReasoning` splits a reply's text as it streams. A call's message goes on with the answer,
rewritten as `<|channel|>commentary to=functions.NAME<|message|>ARGUMENTS<|call|>`, for
`HarmonyCalls` (the `openai` tool-call syntax) to read; so `--tool-call-parser openai` needs the
reasoning parser, and the gateway sets it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from services.gateway.call_text import Calls, JsonScan, begun_tag_length, is_json
from services.gateway.tool_calls import new_call_id, tool_call

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
_BODY_ENDS = (END, CALL, RETURN)
# What a reply's first header can open with: anything else is a reply written without headers.
_HEADER_OPENINGS = (CHANNEL, START, CONSTRAIN, "to=")
FUNCTIONS = "functions."
CALL_OPEN = f"{CHANNEL}commentary to={FUNCTIONS}"
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


@dataclass
class HarmonyReasoning:
    """One choice's harmony text split into (thinking, answer) as it streams: `add` each delta,
    `finish` at the end. `is_thinking`: the message being read is thinking (None in a header, not
    yet known)."""

    is_thinking: bool | None = None
    has_thought: bool = False
    _in_header: bool = True
    _is_at_start: bool = True  # no header read yet: the reply may have none
    _header: str = ""
    _held: str = ""  # a body's last characters, which could begin a marker
    _call: bool = False  # the body being read is a call's arguments

    def add(self, delta: str) -> tuple[str, str]:
        thought, answer, text = [], [], self._held + delta
        self._held = ""
        while text:
            if self._in_header:
                text = self._read_header(text, answer)
            else:
                text = self._read_body(text, thought, answer)
        return "".join(thought), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """What is still held: a body's text; a header cut short is markup, and dropped."""
        held, self._held = self._held, ""
        if self._in_header:
            return "", ""
        return (held, "") if self.is_thinking else ("", held)

    def _read_header(self, text: str, answer: list[str]) -> str:
        header = self._header + text
        end = header.find(MESSAGE)
        if end == -1:
            if self._is_at_start and not _could_open_a_header(header):
                self._start_body(is_thinking=False)
                return header
            self._header = header
            return ""
        self._header = ""
        channel, recipient = _channel(header[:end]), _recipient(header[:end])
        if recipient is not None and recipient.startswith(FUNCTIONS):
            self._start_body(is_thinking=False, is_call=True)
            answer.append(f"{CALL_OPEN}{recipient[len(FUNCTIONS):]}{MESSAGE}")
        else:
            self._start_body(is_thinking=channel == "analysis" or recipient is not None)
        return header[end + len(MESSAGE):]

    def _start_body(self, is_thinking: bool, is_call: bool = False) -> None:
        self._in_header, self._is_at_start, self._call = False, False, is_call
        self.is_thinking = is_thinking
        self.has_thought = self.has_thought or is_thinking

    def _read_body(self, text: str, thought: list[str], answer: list[str]) -> str:
        ends = [(at, marker) for marker in _BODY_ENDS if (at := text.find(marker)) != -1]
        if not ends:
            keep = max(begun_tag_length(text, marker) for marker in _BODY_ENDS)
            self._held = text[len(text) - keep:]
            (thought if self.is_thinking else answer).append(text[:len(text) - keep])
            return ""
        at, marker = min(ends)
        (thought if self.is_thinking else answer).append(text[:at])
        if self._call:
            answer.append(CALL)
        self._in_header, self._call, self.is_thinking = True, False, None
        return text[at + len(marker):]


def _could_open_a_header(text: str) -> bool:
    text = text.lstrip()
    return any(text.startswith(o) or o.startswith(text) for o in _HEADER_OPENINGS)


def _channel(header: str) -> str | None:
    found = _CHANNEL.search(header)
    return found[1] if found else None


def _recipient(header: str) -> str | None:
    found = _RECIPIENT.search(header)
    return found[1] if found else None


class HarmonyCalls:
    """The `openai` tool-call syntax: calls as HarmonyReasoning passes them on with the answer, each
    `CALL_OPEN`, the function's name, `<|message|>`, its arguments' JSON as the model wrote it and
    `<|call|>`. The last call needs none: its `<|call|>` is the model's stop token, which the text
    leaves out. The text before the first call is the answer."""

    reads_special_tokens = True
    call_id = staticmethod(new_call_id)

    @staticmethod
    def template_call_id(call_id: str) -> str:
        return call_id

    def call_start(self, text: str, at_start: bool) -> int | None:
        start = text.find(CALL_OPEN)
        return None if start == -1 else start

    def held_back(self, text: str, at_start: bool) -> int:
        return begun_tag_length(text, CALL_OPEN)

    def parse(self, text: str) -> tuple[str | None, Calls]:
        start = text.find(CALL_OPEN)
        if start == -1:
            return text, []
        calls = []
        for name, arguments in _written_calls(text[start:]):
            if not is_json(arguments):
                return text, []  # cut short or malformed: answered as text, as vLLM's parsers do
            calls.append(tool_call(name, arguments, self.call_id()))
        return text[:start].strip() or None, calls

    def progress(self, text: str, scans: dict[int, JsonScan]) -> list[tuple[str, str]]:
        return _written_calls(text)


def _written_calls(text: str) -> list[tuple[str, str]]:
    """Each call `text` (from a call's start) has begun, as far as its name is whole: (its name, its
    arguments so far)."""
    begun = []
    for piece in text.split(CALL_OPEN)[1:]:
        name, named, rest = piece.partition(MESSAGE)
        if not named:
            break
        arguments, closed, _ = rest.partition(CALL)
        begun.append((name.strip(), arguments))
        if not closed:
            break
    return begun
