"""Mistral's tool calls (`--tool-call-parser mistral`), read as tool_parsers.py reads every syntax:
the calls after `[TOOL_CALLS]`, a special token the text then keeps (as vLLM's parser, it turns
`skip_special_tokens` off for requests it reads): a JSON list of `{"name": ..., "arguments": {...}}`
objects (Mistral 7B v0.3, Nemo), or each call's name, `[ARGS]` and its arguments, the next after
another `[TOOL_CALLS]` (Mistral Small 3.1 and later; a `[CALL_ID]` and id before `[ARGS]` is passed
over). Its calls' ids are 9 letters and digits, the only ids Mistral's chat templates take back."""
from __future__ import annotations

import hashlib
import json
import random
import string

from services.gateway.call_text import (
    BLANK,
    LISTED,
    Calls,
    JsonScan,
    arguments_json,
    begun_tag_length,
    json_end,
    listed_calls,
    objects_so_far,
    past,
)
from services.gateway.tool_calls import tool_call


class Mistral:
    """Calls after `[TOOL_CALLS]`, wherever it comes: a JSON list of them, or each one named."""

    START, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    reads_special_tokens = True
    _ID_CHARACTERS = string.ascii_letters + string.digits

    @classmethod
    def call_id(cls) -> str:
        return "".join(random.choices(cls._ID_CHARACTERS, k=9))

    @classmethod
    def template_call_id(cls, call_id: str) -> str:
        """Mistral's templates refuse an id that is not 9 letters and digits, and clients written for
        OpenAI send theirs ("call_..."): such an id becomes 9 made from its hash, the same for the
        call and for the tool message answering it, as vLLM shortens them for Mistral."""
        if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
            return call_id
        number = int.from_bytes(hashlib.blake2b(call_id.encode(), digest_size=8).digest(), "little")
        letters = []
        for _ in range(9):
            number, digit = divmod(number, len(cls._ID_CHARACTERS))
            letters.append(cls._ID_CHARACTERS[digit])
        return "".join(letters)

    def call_start(self, text: str, at_start: bool) -> int | None:
        start = text.find(self.START)
        return None if start == -1 else start

    def held_back(self, text: str, at_start: bool) -> int:
        return begun_tag_length(text, self.START)

    def parse(self, text: str) -> tuple[str | None, Calls]:
        start = text.find(self.START)
        if start == -1:
            return text, []
        region = text[start:]
        calls = self._listed(region) if self._is_listed(region) else self._named(region)
        if not calls:
            return text, []
        for call in calls:
            call["id"] = self.call_id()
        return text[:start].strip() or None, calls

    def progress(self, text: str, scans: dict[int, JsonScan]) -> list[tuple[str, str]]:
        if self._is_listed(text):
            return objects_so_far(text, past(text, len(self.START), BLANK) + 1, LISTED, scans)
        begun, start = [], 0
        while start != -1:
            call = self._named_so_far(text, start, scans)
            if call is None:
                break
            begun.append(call[:2])
            start = call[2]
        return begun

    def _is_listed(self, region: str) -> bool:
        """The calls are a JSON list (tokenizer v3), not named one by one."""
        at = past(region, len(self.START), BLANK)
        return at < len(region) and region[at] == "["

    def _listed(self, region: str) -> Calls | None:
        return listed_calls(region[len(self.START):].strip(), "arguments")

    def _named(self, region: str) -> Calls | None:
        calls = []
        for piece in region.split(self.START)[1:]:
            head, is_named, value = piece.partition(self.ARGS)
            name = head.partition(self.CALL_ID)[0].strip()
            if not is_named or not name:
                return None
            value = value.strip()
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError:
                return None
            calls.append(tool_call(name, value if isinstance(parsed, (dict, list)) else arguments_json(parsed)))
        return calls

    def _named_so_far(self, text: str, start: int, scans: dict[int, JsonScan]) -> tuple[str, str, int] | None:
        """A call named at `text[start:]` (its `[TOOL_CALLS]`): its name, its arguments' text so far,
        and where the next call starts (-1: none yet); None before its name is whole."""
        name_at = start + len(self.START)
        args_at = text.find(self.ARGS, name_at)
        if args_at == -1:
            return None
        name = text[name_at:args_at].partition(self.CALL_ID)[0].strip()
        if not name:
            return None
        value_at = past(text, args_at + len(self.ARGS), BLANK)
        if value_at == len(text) or text[value_at] not in "{[":
            return name, "", text.find(self.START, value_at)
        end = json_end(text, value_at, scans)
        if end is None:
            return name, text[value_at:], -1
        return name, text[value_at:end], text.find(self.START, end)
