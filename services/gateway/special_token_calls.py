"""Tool calls between special tokens, read as vLLM's parsers read them: after any text the model
says first, a token opening the calls, then each call between its own begin and end tokens.

- `deepseek_v3` (DeepSeek-V3, R1-0528): `<｜tool▁calls▁begin｜>`, each call
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`, a newline and the arguments' JSON in a ```json
  fence, `<｜tool▁call▁end｜>`;
- `deepseek_v31` (V3.1, V3.2): the same tokens, a call `NAME<｜tool▁sep｜>` and the arguments' JSON;
- `kimi_k2` (Kimi K2): `<|tool_calls_section_begin|>`, each call `<|tool_call_begin|>`, the model's
  id for it (`functions.NAME:INDEX`, NAME the function's), `<|tool_call_argument_begin|>`, the
  arguments' JSON, `<|tool_call_end|>`. Calls get OpenAI-style ids, as the other parsers' do (vLLM
  gives Kimi's own): the same whether streamed or not.

The arguments are the model's JSON text, as written. The markers are special tokens, so requests
read for calls keep special tokens in their text (as vLLM's parsers ask). Streaming: a call's id and
name go out once its name is whole, its arguments once the call ends.
"""
from __future__ import annotations

import re

from services.gateway.call_text import Calls, JsonScan, begun_tag_length, is_json
from services.gateway.tool_calls import new_call_id, tool_call

SEP = "<｜tool▁sep｜>"  # DeepSeek's, between a call's name and its arguments


class _SpecialTokenCalls:
    reads_special_tokens = True
    call_id = staticmethod(new_call_id)
    CALLS_BEGIN, CALL_BEGIN, CALL_END = "", "", ""
    # A call's text between its begin and end tokens: its name (group "name"), its arguments' JSON
    # (group "arguments").
    CALL: re.Pattern
    NAMED: re.Pattern  # a call's beginning once its name is whole

    @staticmethod
    def template_call_id(call_id: str) -> str:
        return call_id

    def call_start(self, text: str, at_start: bool) -> int | None:
        start = text.find(self.CALLS_BEGIN)
        return None if start == -1 else start

    def held_back(self, text: str, at_start: bool) -> int:
        return begun_tag_length(text, self.CALLS_BEGIN)

    def parse(self, text: str) -> tuple[str | None, Calls]:
        start = text.find(self.CALLS_BEGIN)
        if start == -1:
            return text, []
        calls = []
        for piece in text[start:].split(self.CALL_BEGIN)[1:]:
            match = self.CALL.fullmatch(piece.split(self.CALL_END)[0]) if self.CALL_END in piece else None
            if match is None or not is_json(match["arguments"]):
                return text, []  # cut short or malformed: answered as text, as vLLM's parsers do
            calls.append(tool_call(self._name(match["name"]), match["arguments"].strip()))
        if not calls:
            return text, []
        return text[:start].strip() or None, calls

    def progress(self, text: str, scans: dict[int, JsonScan]) -> list[tuple[str, str]]:
        begun = []
        for piece in text.split(self.CALL_BEGIN)[1:]:
            is_closed = self.CALL_END in piece
            body = piece.split(self.CALL_END)[0]
            whole = self.CALL.fullmatch(body) if is_closed else None
            named = whole or self.NAMED.match(body)
            if named is None:
                break
            begun.append((self._name(named["name"]), whole["arguments"].strip() if whole else ""))
            if not is_closed:
                break
        return begun

    @staticmethod
    def _name(written: str) -> str:
        return written.strip()


class _DeepSeekCalls(_SpecialTokenCalls):
    CALLS_BEGIN, CALL_BEGIN, CALL_END = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"


class DeepSeekV3(_DeepSeekCalls):
    CALL = re.compile(r"(?P<type>[^<]*)" + re.escape(SEP) + r"(?P<name>[^\n]*)\n```json\n(?P<arguments>.*)\n```\s*",
                      re.DOTALL)
    NAMED = re.compile(r"[^<]*" + re.escape(SEP) + r"(?P<name>[^\n]+)\n")


class DeepSeekV31(_DeepSeekCalls):
    CALL = re.compile(r"(?P<name>[^<]*)" + re.escape(SEP) + r"(?P<arguments>.*)", re.DOTALL)
    NAMED = re.compile(r"(?P<name>[^<]+)" + re.escape(SEP))


class KimiK2(_SpecialTokenCalls):
    CALLS_BEGIN, CALL_BEGIN, CALL_END = "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_end|>"
    CALL = re.compile(r"\s*(?P<name>[^<]+?:\d+)\s*<\|tool_call_argument_begin\|>(?P<arguments>.*)", re.DOTALL)
    NAMED = re.compile(r"\s*(?P<name>[^<]+?:\d+)\s*<\|tool_call_argument_begin\|>")

    @staticmethod
    def _name(written: str) -> str:
        # `functions.get_weather:0`: the function's name between the namespace and the call's index.
        return written.strip().rsplit(":", 1)[0].split(".")[-1]
