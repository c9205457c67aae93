"""How a request body written for another server reads as the OpenAI API's fields here: SGLang's
names for vLLM's extras, and null in the fields OpenAI's API documents as nullable."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.gateway.errors import FieldError

# Fields OpenAI's API documents as nullable whose null means their default here: clients generated from
# its spec send them so (vLLM's models take null for these, and refuse it for its own extras).
NULL_IS_DEFAULT = ("n", "stream", "logprobs", "echo", "parallel_tool_calls")
# SGLang's OpenAI API's extras by the name of the field here that does the same: its clients send them.
SGLANG_ALIASES = {"regex": "guided_regex", "ebnf": "guided_grammar", "json_schema": "guided_json",
                  "no_stop_trim": "include_stop_str_in_output"}


def with_sglang_names(data: Any) -> Any:
    """A request body with SGLang's extras under the names of the fields here; FieldError for one given
    by both names."""
    if not isinstance(data, dict) or not any(data.get(name) is not None for name in SGLANG_ALIASES):
        return data
    renamed = dict(data)
    for theirs, ours in SGLANG_ALIASES.items():
        if renamed.get(theirs) is None:
            continue
        if renamed.get(ours) is not None:
            raise FieldError(theirs, f"give one of {theirs} and {ours}, not both")
        renamed[ours] = renamed.pop(theirs)
    return renamed


def without_nulls(data: Any, names: Sequence[str]) -> Any:
    """A request body with the fields `names` left out where they are null, so they take their defaults."""
    if isinstance(data, dict) and any(data.get(name, ...) is None for name in names):
        return {key: value for key, value in data.items() if not (value is None and key in names)}
    return data
