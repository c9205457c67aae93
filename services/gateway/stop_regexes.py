"""SGLang's `stop_regex` (a pattern or a list): the text ends where one first matches, as at a stop
string (services/tokenizer/stop_strings.py matches them). Compiled once, when the request is read."""
from __future__ import annotations

import regex

from services.gateway.errors import FieldError


def compiled_stop_regexes(given: str | list[str] | None) -> tuple[regex.Pattern, ...]:
    """FieldError (a 400 naming stop_regex) for a pattern that does not compile, or that matches the
    empty text: it would end every output before its first character."""
    patterns = [given] if isinstance(given, str) else list(given or ())
    compiled = []
    for pattern in dict.fromkeys(patterns):
        try:
            stop = regex.compile(pattern)
        except regex.error as e:
            raise FieldError("stop_regex", f"stop_regex {pattern!r} is not a regular expression: {e}") from None
        if stop.search("") is not None:
            raise FieldError("stop_regex", f"stop_regex {pattern!r} matches the empty text")
        compiled.append(stop)
    return tuple(compiled)
