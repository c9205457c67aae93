"""Turning a stream of generated token ids into a stream of text deltas.

Decoding token by token is wrong twice over: a character split across several
byte tokens decodes to U+FFFD until its last byte arrives, and SentencePiece
tokenizers drop the leading space of whatever they decode first, so " world"
decoded alone reads "world". vLLM's prefix_offset / read_offset algorithm
avoids both by decoding a short window that starts a few tokens back:

    ids:  ... | prefix_offset ... read_offset | new ids
    delta = decode(ids[prefix_offset:]) minus decode(ids[prefix_offset:read_offset])

and holding the delta back while it ends in U+FFFD (an unfinished character).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context before the first generated token: enough for a
# leading space or a multi-token character that starts in the prompt.
INITIAL_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Text deltas for one request's generated tokens.

    Contract: the concatenation of every `add` result and `finish()` equals the text
    the generated tokens add to the prompt, i.e. `decode(prompt + output)` minus
    `decode(prompt)`; with an empty prompt, exactly `decode(output)`. No delta
    ends in a partial character: a U+FFFD is emitted only when the tokens can no
    longer complete it (or by `finish`).
    """

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # The prompt's tail is context only: decoded, never emitted.
        self._ids = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the decoded window
        self._read_offset = len(self._ids)  # tokens before this have been emitted
        self.output_token_ids: list[int] = []
        # The window's already-emitted part, decoded: the same until the next emit. The first one
        # (the prompt's tail) is decoded here, before any token comes: the gateway makes this while
        # the prompt computes, and the first token's way out then decodes once, not twice.
        self._prefix_text = tokenizer.decode(self._ids, skip_special_tokens=skip_special_tokens)

    def add(self, token_ids: Iterable[int]) -> str:
        """Append generated tokens; return the text they complete (may be "")."""
        new_ids = list(token_ids)
        if not new_ids:
            return ""
        self._ids += new_ids
        self.output_token_ids += new_ids
        prefix_text, window_text = self._decode_window()
        # An unfinished character (U+FFFD at the end) or a token that adds no text
        # yet (e.g. a skipped special token) waits for the next token.
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(prefix_text, window_text)

    def finish(self) -> str:
        """Flush whatever is held back, broken characters included; the stream is done."""
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text, window_text = self._decode_window()
        if len(window_text) <= len(prefix_text):
            self._read_offset = len(self._ids)
            self._prefix_text = None
            return ""
        return self._emit(prefix_text, window_text)

    def _decode_window(self) -> tuple[str, str]:
        decode, skip = self._tokenizer.decode, self._skip_special_tokens
        if self._prefix_text is None:
            self._prefix_text = decode(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=skip)
        return self._prefix_text, decode(self._ids[self._prefix_offset:], skip_special_tokens=skip)

    def _emit(self, prefix_text: str, window_text: str) -> str:
        # The emitted tokens become the next window's context; older ids are no
        # longer decoded, so they are dropped to keep each step O(window).
        del self._ids[:self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._prefix_text = None
        return window_text[len(prefix_text):]
