"""Tool-call parsers: calls out of a whole text, and out of a stream cut anywhere."""
from __future__ import annotations

import json

import pytest

from services.gateway.tool_parsers import PARSERS, StreamedCalls

HERMES, LLAMA3, PYTHONIC = PARSERS["hermes"], PARSERS["llama3_json"], PARSERS["pythonic"]
HERMES_TEXT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
LLAMA3_TEXT = '{"name": "get_weather", "parameters": {"city": "Zürich"}}; {"name": "get_time", "parameters": {}}'
PYTHONIC_TEXT = '[get_weather(city="Zürich"), get_time()]'
CALLS = [("get_weather", {"city": "Zürich"}), ("get_time", {})]


def named(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_calls_and_the_text_before_them():
    content, calls = HERMES.parse(HERMES_TEXT)
    assert content == "Let me look." and named(calls) == CALLS
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert HERMES.parse('<tool_call>{"name": "f", "arguments": {"a": 1}}')[0] is None  # cut before its end
    content, calls = LLAMA3.parse(LLAMA3_TEXT)
    assert content is None and named(calls) == CALLS
    assert named(LLAMA3.parse("  " + LLAMA3_TEXT + "\n")[1]) == CALLS
    content, calls = PYTHONIC.parse(PYTHONIC_TEXT)
    assert content is None and named(calls) == CALLS
    nested = PYTHONIC.parse('[f(n=1, xs=[1.5, None], on=True, by={"k": "v"})]')[1]
    assert named(nested) == [("f", {"n": 1, "xs": [1.5, None], "on": True, "by": {"k": "v"}})]


@pytest.mark.parametrize(("syntax", "text"), [
    (HERMES, "no calls here"), (HERMES, "<tool_call>{not json}</tool_call>"), (HERMES, "<tool_call>[1]</tool_call>"),
    (HERMES, 'text <tool_call>{"arguments": {}}</tool_call>'), (LLAMA3, "The weather is fine."),
    (LLAMA3, '{"name": "f", "parameters": {}} and then some'), (LLAMA3, '{"city": "Paris"}'),
    (PYTHONIC, "[1, 2]"), (PYTHONIC, "[f(1)]"), (PYTHONIC, "[f(x=y)]"), (PYTHONIC, "[f(**kw)]"), (PYTHONIC, "[]"),
    (PYTHONIC, "[f(x={1, 2})]"), (PYTHONIC, "[obj.f(x=1)]"), (PYTHONIC, "[f(x=1)] and more"), (PYTHONIC, "Sunny."),
])
def test_a_text_without_whole_calls_is_answered_as_text(syntax, text):
    assert syntax.parse(text) == (text, [])


@pytest.mark.parametrize(("syntax", "text", "said"), [(HERMES, HERMES_TEXT, "Let me look."), (LLAMA3, LLAMA3_TEXT, ""),
                                                      (PYTHONIC, PYTHONIC_TEXT, "")])
@pytest.mark.parametrize("cut", [1, 2, 5, 7, 13])
def test_a_stream_sends_the_text_before_the_calls_and_never_part_of_a_call(syntax, text, said, cut):
    stream = StreamedCalls(syntax)
    sent = "".join(stream.add(text[i:i + cut]) for i in range(0, len(text), cut))
    assert "<" not in sent and "{" not in sent and sent.strip() == said
    assert stream.finish() == ""
    assert named(stream.calls) == CALLS


def test_a_stream_without_calls_holds_back_only_what_could_start_one():
    stream = StreamedCalls(HERMES)
    assert stream.add("a < b and <tool") == "a < b and "
    assert stream.add("box>") == "<toolbox>"
    assert stream.add(" end <") == " end "
    assert stream.finish() == "<" and stream.calls == []
    llama = StreamedCalls(LLAMA3)
    assert llama.add(" ") == ""  # a call may still come
    assert llama.add("Sunny, ") == " Sunny, "
    assert llama.add('{"json": "later is text"}') == '{"json": "later is text"}'
    assert llama.finish() == "" and llama.calls == []
