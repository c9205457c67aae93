"""`baton generate`'s output: the text of a request's tokens as they come, written as it becomes whole."""
from __future__ import annotations

from collections.abc import Sequence


class StreamingText:
    """Decodes a growing list of output ids and writes only the new text.

    The whole output is re-decoded each time, because a byte-level token may end
    mid-character; text ending in U+FFFD (an incomplete UTF-8 sequence) is held
    back until the next token completes it, or until `finish`.
    """

    def __init__(self, tokenizer, stream) -> None:
        self.tokenizer = tokenizer
        self.stream = stream
        self.text = ""
        self.num_written = 0

    def update(self, token_ids: Sequence[int]) -> None:
        self.text = self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
        self._write(self.text.rstrip("\ufffd"))

    def finish(self) -> None:
        self._write(self.text)
        if self.stream is not None and self.num_written:
            self.stream.write("\n")
            self.stream.flush()

    def _write(self, stable: str) -> None:
        if self.stream is None or len(stable) <= self.num_written:
            return
        self.stream.write(stable[self.num_written:])
        self.stream.flush()
        self.num_written = len(stable)
