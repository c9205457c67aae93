"""Stop strings, matched on the detokenized text as it streams.

A stop string can span several deltas ("</" then "answer>"), so text that could
still turn out to be the start of one is held back until the next delta decides
it. Text is therefore never emitted and then taken back, and nothing after a
stop string ever leaves.
"""
from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Filters one request's text deltas through its stop strings.

    Contract: feeding deltas d1..dn returns texts whose concatenation (plus
    `finish()` when no stop matched) is the whole text cut just before the
    earliest occurrence of any stop string (just after it with
    `include_stop_str_in_output`). Once stopped, every call returns ("", True).
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False):
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = tuple(dict.fromkeys(stop))
        self.include_stop_str_in_output = include_stop_str_in_output
        self.matched_stop: str | None = None  # the stop string that ended the text, for finish reasons
        self._pending = ""  # received, not yet emitted; never contains a whole stop string

    @property
    def is_stopped(self) -> bool:
        return self.matched_stop is not None

    def add(self, delta: str) -> tuple[str, bool]:
        """Take the next text delta; return (text safe to emit now, stopped)."""
        if self.is_stopped:
            return "", True
        text = self._pending + delta
        match = self._earliest_match(text)
        if match is not None:
            start, stop = match
            self.matched_stop, self._pending = stop, ""
            end = start + len(stop) if self.include_stop_str_in_output else start
            return text[:end], True
        held = self._partial_stop_length(text)
        self._pending = text[len(text) - held:]
        return text[:len(text) - held], False

    def finish(self) -> str:
        """The held-back text, released because generation ended without a stop."""
        if self.is_stopped:
            return ""
        text, self._pending = self._pending, ""
        return text

    def _earliest_match(self, text: str) -> tuple[int, str] | None:
        # Earliest start wins; at the same start the first listed stop string.
        best: tuple[int, str] | None = None
        for stop in self.stop:
            start = text.find(stop)
            if start != -1 and (best is None or start < best[0]):
                best = (start, stop)
        return best

    def _partial_stop_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
