"""Structured output: what a request asks its text to be, as the one regular expression or
grammar the workers guide decoding by (engine/guided_decoding.py).

OpenAI's `response_format` (`json_object`: a JSON object; `json_schema`: one its schema
allows; vLLM's `structural_tag`), vLLM's extras `guided_json` (a schema), `guided_regex`,
`guided_choice` (one of the strings given) and `guided_grammar` (Lark or GBNF), or the same in
vLLM's newer `structured_outputs` object (`json`, `regex`, `choice`, `json_object`, `grammar`,
`structural_tag`). A regex or a choice goes to the workers as a regex (outlines-core compiles it);
a JSON schema as llguidance's JSON grammar of it, as vLLM's guidance backend does it: nothing to
compile ahead (a regex of any JSON object took outlines-core seconds for a small vocabulary), any
nesting depth, single spaces at most between tokens, objects that list their properties closed to
others unless they say otherwise (as outlines-core and vLLM's default xgrammar read them). A
grammar goes as it came, once it is known to compile (engine/grammars.py), a structural tag as the
llguidance grammar it stands for. One request may ask for one of them.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher, StructTag

from engine.grammars import check_grammar
from protos import common_pb2
from services.gateway.errors import FieldError

# What `json_object` allows, and a function without parameters takes: an open object.
ANY_JSON_OBJECT = {"type": "object"}


# How guided JSON is laid out: a space at most between tokens. llguidance's default, any whitespace
# anywhere, lets a model pad it with runs of newlines.
JSON_LAYOUT = {"whitespace_pattern": "[ ]?"}


@dataclass(frozen=True)
class OutputGuide:
    """What the workers hold a text to: a regex or a grammar."""

    regex: str | None = None
    grammar: str | None = None

    def write_into(self, params: common_pb2.SamplingParams) -> None:
        if self.regex is not None:
            params.guided_regex = self.regex
        else:
            params.guided_grammar = self.grammar


def is_guided(params: common_pb2.SamplingParams) -> bool:
    return params.HasField("guided_regex") or params.HasField("guided_grammar")


def output_guide(response_format: dict[str, Any] | None, guided_json: dict[str, Any] | str | None,
                 regex: str | None, choice: list[str] | None, grammar: str | None = None,
                 structured_outputs: dict[str, Any] | None = None) -> OutputGuide | None:
    """What the output must match; None when nothing is asked. FieldError for an ask that cannot
    be met, naming its field. `structured_outputs`: vLLM's object of that name."""
    named = [("response_format", response_format if _is_structured(response_format) else None),
             ("guided_json", guided_json), ("guided_regex", regex), ("guided_choice", choice),
             ("guided_grammar", grammar)]
    if structured_outputs:
        as_json = ANY_JSON_OBJECT if structured_outputs.get("json_object") else None
        named += [("structured_outputs.json", structured_outputs.get("json")),
                  ("structured_outputs.json_object", as_json),
                  ("structured_outputs.regex", structured_outputs.get("regex")),
                  ("structured_outputs.choice", structured_outputs.get("choice")),
                  ("structured_outputs.grammar", structured_outputs.get("grammar")),
                  ("structured_outputs.structural_tag", structured_outputs.get("structural_tag"))]
    asks = [(name, value) for name, value in named if value is not None]
    if len(asks) > 1:
        raise FieldError(asks[1][0], f"ask for one structured output at most, not "
                                     f"{' and '.join(name for name, _ in asks)}")
    if not asks:
        return None
    name, value = asks[0]
    try:
        return _guide(name, value)
    except ValueError as e:
        raise FieldError(name, str(e)) from None


def _guide(name: str, value: Any) -> OutputGuide:
    if name == "response_format":
        return _formatted(value)
    if name.endswith("regex"):
        return OutputGuide(regex=value)
    if name.endswith("choice"):
        if not value or any(not c for c in value):
            raise ValueError("must be a list of non-empty strings")
        return OutputGuide(regex="(" + "|".join(re.escape(c) for c in value) + ")")
    if name.endswith("grammar"):
        if not value.strip():
            raise ValueError("must be a grammar, not an empty string")
        check_grammar(value)
        return OutputGuide(grammar=value)
    if name.endswith("structural_tag"):
        grammar = structural_tag_grammar(value)
        check_grammar(grammar)  # its schemas': llguidance's JSON compiler takes most, not all
        return OutputGuide(grammar=grammar)
    return schema_guide(value)  # a JSON schema: guided_json or structured_outputs' json(_object)


def schema_guide(schema: dict[str, Any] | str) -> OutputGuide:
    """The guide of the JSON a schema allows; ValueError when llguidance cannot use it."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not JSON: {e}") from None
    if not isinstance(schema, dict | bool):
        raise ValueError("the JSON schema must be an object")
    grammar = LLMatcher.grammar_from_json_schema(closed_objects(schema), overrides=JSON_LAYOUT)
    try:
        check_grammar(grammar)
    except ValueError as e:  # llguidance's words, e.g. "Invalid type: nonsense"
        raise ValueError(str(e).replace("the grammar cannot be compiled", "the JSON schema cannot be used")) from None
    return OutputGuide(grammar=grammar)


def closed_objects(schema: Any) -> Any:
    """`schema` with each object that lists its properties held to them unless it says otherwise
    (`additionalProperties`), as vLLM's default backend (xgrammar, strict) and outlines-core read a
    schema: a model given a tool's parameters writes those, not keys of its own."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: closed_objects(value) for key, value in schema.items()}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def structural_tag_grammar(spec: dict[str, Any] | str) -> str:
    """The llguidance grammar of vLLM's structural tag: free text in which each of `triggers` must
    go on as one of the `structures` beginning with it does (its `begin`, JSON its `schema` allows,
    its `end`), as a model's tool calls in its own syntax. ValueError for a spec that is not one."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"a structural tag must be a JSON object: {e}") from None
    structures, triggers = (spec.get("structures"), spec.get("triggers")) if isinstance(spec, dict) else (None, None)
    if not structures or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("a structural tag needs structures (each a begin, a schema and an end) and triggers "
                         "(non-empty strings a structure's begin starts with)")
    tags = []
    for structure in structures:
        begin, schema, end = (structure.get(key) for key in ("begin", "schema", "end")) \
            if isinstance(structure, dict) else (None, None, None)
        if not isinstance(begin, str) or not isinstance(end, str) or not isinstance(schema, dict):
            raise ValueError("each of a structural tag's structures needs begin and end (strings) and schema "
                             "(a JSON schema)")
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise ValueError(f"the structure beginning {begin!r} starts with none of the triggers")
        arguments = {**closed_objects(schema), "x-guidance": JSON_LAYOUT}
        tags.append(StructTag(trigger=trigger, begin=begin, grammar=arguments, end=end))
    # A trigger is matched as text: a model writing it as one special token would never set it off.
    return StructTag.to_grammar(tags, assume_special=False)


def _is_structured(response_format: dict[str, Any] | None) -> bool:
    return response_format is not None and response_format.get("type") not in (None, "text")


def _formatted(response_format: dict[str, Any]) -> OutputGuide:
    """What OpenAI's `response_format` (not plain text) asks for."""
    kind = response_format.get("type")
    if kind == "json_object":
        return schema_guide(ANY_JSON_OBJECT)
    if kind == "json_schema":
        json_schema = response_format.get("json_schema")
        schema = json_schema.get("schema") if isinstance(json_schema, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format json_schema needs json_schema.schema, a JSON schema object")
        return schema_guide(schema)
    if kind == "structural_tag":
        return _guide("structured_outputs.structural_tag", response_format)
    raise ValueError(f"response_format type must be text, json_object, json_schema or structural_tag, got {kind!r}")
