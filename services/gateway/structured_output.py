"""Structured output: what a request asks its text to be, as the one regular expression the
workers guide decoding by (engine/guided_decoding.py).

OpenAI's `response_format` (`json_object`: a JSON object; `json_schema`: one its schema
allows) and vLLM's extras `guided_json` (a schema), `guided_regex` and `guided_choice` (one
of the strings given), or the same in vLLM's newer `structured_outputs` object (`json`,
`regex`, `choice`, `json_object`; its `grammar` and `structural_tag` need a grammar engine
this gateway does not have, and are refused). A JSON schema becomes a regex by outlines-core,
as vLLM's outlines backend does it: the JSON it allows has a bounded nesting depth and single
spaces at most between tokens. One request may ask for one of them.
"""
from __future__ import annotations

import json
import re
from typing import Any

from outlines_core.json_schema import build_regex_from_schema

# What `json_object` allows, and a function without parameters takes: an open object (with the
# nesting depth outlines-core writes one to).
ANY_JSON_OBJECT = {"type": "object"}


UNSERVED_STRUCTURED_OUTPUTS = ("grammar", "structural_tag")


def guided_regex(response_format: dict[str, Any] | None, guided_json: dict[str, Any] | str | None,
                 regex: str | None, choice: list[str] | None,
                 structured_outputs: dict[str, Any] | None = None) -> str | None:
    """The regex the output must match; None when nothing is asked. ValueError for an ask that
    cannot be met, worded for the client. `structured_outputs`: vLLM's object of that name."""
    formatted = _structured(response_format)
    named = [("response_format", formatted), ("guided_json", guided_json), ("guided_regex", regex),
             ("guided_choice", choice)]
    if structured_outputs:
        for key in UNSERVED_STRUCTURED_OUTPUTS:
            if structured_outputs.get(key) is not None:
                raise ValueError(f"structured_outputs.{key} is not supported: ask for json, regex or choice")
        as_json = ANY_JSON_OBJECT if structured_outputs.get("json_object") else None
        named += [("structured_outputs.json", structured_outputs.get("json")),
                  ("structured_outputs.json_object", as_json),
                  ("structured_outputs.regex", structured_outputs.get("regex")),
                  ("structured_outputs.choice", structured_outputs.get("choice"))]
    asks = [(name, value) for name, value in named if value is not None]
    if len(asks) > 1:
        raise ValueError(f"ask for one structured output at most, not {' and '.join(name for name, _ in asks)}")
    if not asks:
        return None
    name, value = asks[0]
    if name.endswith("regex"):
        return value
    if name.endswith("choice"):
        if not value or any(not c for c in value):
            raise ValueError(f"{name} must be a list of non-empty strings")
        return "(" + "|".join(re.escape(c) for c in value) + ")"
    return schema_regex(value)  # a JSON schema: response_format's, guided_json or structured_outputs' json


def schema_regex(schema: dict[str, Any] | str) -> str:
    """The regex of the JSON a schema allows; ValueError when outlines-core cannot use it."""
    try:
        return build_regex_from_schema(schema if isinstance(schema, str) else json.dumps(schema))
    except (ValueError, TypeError) as e:  # outlines-core's words, e.g. "Unsupported type: nonsense"
        raise ValueError(f"the JSON schema cannot be used: {e}") from None


def _structured(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """The schema OpenAI's `response_format` asks for; None for plain text."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return ANY_JSON_OBJECT
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise ValueError("response_format json_schema needs json_schema.schema, a JSON schema object")
        return schema
    raise ValueError(f"response_format type must be text, json_object or json_schema, got {kind!r}")
