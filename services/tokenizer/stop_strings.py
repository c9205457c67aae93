"""Stop strings and stop regexes (SGLang's `stop_regex`), matched on the detokenized text as it
streams.

A stop string can span several deltas ("</" then "answer>"), so text that could still turn out to
be the start of one is held back until the next delta decides it; for a regex, text from where a
partial match of it begins (the `regex` module's partial matching). Text is therefore never
emitted and then taken back, and nothing after a stop ever leaves.
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Sequence

import regex

Stop = str | regex.Pattern  # a stop string, or a compiled stop regex
# A client's regexes run on the gateway's event loop: a request whose searches together take longer
# (one that backtracks, or many slow ones) fails instead of stalling every other.
SEARCH_BUDGET_S = 0.5
FEW_STOPS = 16  # stop strings read one by one on every delta; more are looked up


class StopRegexTimeout(ValueError):
    """A request's stop regexes took their SEARCH_BUDGET_S."""


class StopStringMatcher:
    """Filters one request's text deltas through its stop strings and regexes.

    Contract: feeding deltas d1..dn returns texts whose concatenation (plus `finish()` when no stop
    matched) is the whole text cut just before the earliest match of any stop string or regex (just
    after it with `include_stop_str_in_output`); at the same start, stop strings first, each in its
    order. A regex is looked for in the text not yet emitted, with what was before it (its anchors and
    lookbehinds see the whole text), and ends the text at the first complete match a delta brings (a
    greedy pattern does not wait for more). Once stopped, every call returns ("", True).
    """

    def __init__(self, stop: Sequence[Stop], include_stop_str_in_output: bool = False):
        strings = [s for s in stop if isinstance(s, str)]
        if any(not s for s in strings):
            raise ValueError("stop strings must be non-empty")
        self.stop = tuple(dict.fromkeys(strings))
        # Past FEW_STOPS, looked up by length and by prefix, not read one by one on every delta: 100,000 stop
        # strings held the gateway's event loop, every stream on it, 80 ms per token (now ~7 us; 2-5 us read
        # one by one for a few, 6 us looked up).
        self._is_indexed = len(self.stop) > FEW_STOPS
        if self._is_indexed:  # (built on every request's path: not for the few)
            self._order = {stop: i for i, stop in enumerate(self.stop)}
            self._lengths = sorted({len(stop) for stop in self.stop})
            self._sorted = sorted(self.stop)
        self.patterns = tuple(s for s in stop if not isinstance(s, str))
        self.include_stop_str_in_output = include_stop_str_in_output
        self.matched_stop: str | None = None  # the stop string (or regex pattern) that ended the text
        self._pending = ""  # received, not yet emitted; never contains a whole stop
        self._emitted = ""  # kept only for the regexes
        self._search_budget_s = SEARCH_BUDGET_S  # what the regexes' searches may still take

    @property
    def is_stopped(self) -> bool:
        return self.matched_stop is not None

    def add(self, delta: str) -> tuple[str, bool]:
        """Take the next text delta; return (text safe to emit now, stopped). StopRegexTimeout once the
        regexes' searches have taken their budget."""
        if self.is_stopped:
            return "", True
        text = self._pending + delta
        whole = self._emitted + text if self.patterns else text  # what the regexes see: the text sent too
        match = self._earliest_match(text, whole, len(self._pending))
        if match is not None:
            start, end, stop = match
            self.matched_stop, self._pending = stop, ""
            return text[:end if self.include_stop_str_in_output else start], True
        held = max(self._partial_stop_length(text), self._partial_pattern_length(whole))
        self._pending = text[len(text) - held:]
        emitted = text[:len(text) - held]
        if self.patterns:
            self._emitted += emitted
        return emitted, False

    def finish(self) -> str:
        """The held-back text, released because generation ended without a stop."""
        if self.is_stopped:
            return ""
        text, self._pending = self._pending, ""
        return text

    def _earliest_match(self, text: str, whole: str, num_held: int) -> tuple[int, int, str] | None:
        """(start, end, stop) of the earliest match in `text`, the pending text (its first `num_held` characters
        held back before: none of them ends a match); `whole`: the text sent, then it."""
        best: tuple[int, int, str] | None = None
        if self._is_indexed:
            found = [(end - length, self._order[text[end - length:end]], end)
                     for end in range(num_held + 1, len(text) + 1) for length in self._lengths
                     if length <= end and text[end - length:end] in self._order]
            if found:
                start, order, end = min(found)
                best = (start, end, self.stop[order])
        else:
            for stop in self.stop:
                start = text.find(stop)
                if start != -1 and (best is None or start < best[0]):
                    best = (start, start + len(stop), stop)
        offset = len(whole) - len(text)
        for pattern in self.patterns:
            match = self._search(pattern, whole, partial=False)
            if match is not None and (best is None or match.start() - offset < best[0]):
                best = (match.start() - offset, match.end() - offset, pattern.pattern)
        return best

    def _partial_stop_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        if not self._is_indexed:
            longest = 0
            for stop in self.stop:
                for length in range(min(len(stop) - 1, len(text)), longest, -1):
                    if text.endswith(stop[:length]):
                        longest = length
                        break
            return longest
        for length in range(min(self._lengths[-1] - 1, len(text)), 0, -1):
            suffix = text[len(text) - length:]
            # The stop strings it begins, if any, sort from where it would go among them.
            at = bisect.bisect_left(self._sorted, suffix)
            if at < len(self._sorted) and self._sorted[at] == suffix:  # a whole stop: a longer one may follow
                at += 1
            if at < len(self._sorted) and self._sorted[at].startswith(suffix):
                return length
        return 0

    def _partial_pattern_length(self, whole: str) -> int:
        """Length of the suffix of `whole` from where the earliest partial match of a regex begins."""
        longest = 0
        for pattern in self.patterns:
            match = self._search(pattern, whole, partial=True)
            if match is not None and match.partial:
                longest = max(longest, len(whole) - match.start())
        return longest

    def _search(self, pattern: regex.Pattern, whole: str, partial: bool) -> regex.Match | None:
        """`pattern` looked for from the end of the text sent on (its matches begin in the pending text)."""
        start = time.perf_counter()
        try:
            return pattern.search(whole, len(self._emitted), partial=partial, timeout=max(self._search_budget_s, 1e-6))
        except TimeoutError:
            raise StopRegexTimeout(f"stop_regex {pattern.pattern!r}: searching the output took over the "
                                   f"{SEARCH_BUDGET_S} s a request's stop regexes may take") from None
        finally:
            self._search_budget_s -= time.perf_counter() - start
