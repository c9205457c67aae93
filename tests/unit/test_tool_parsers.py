"""The Hermes tool-call parser: calls out of a whole text, and out of a stream cut anywhere."""
from __future__ import annotations

import json

import pytest

from services.gateway.tool_parsers import StreamedCalls, parse_hermes

TEXT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def named(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_calls_and_the_text_before_them():
    content, calls = parse_hermes(TEXT)
    assert content == "Let me look."
    assert named(calls) == [("get_weather", {"city": "Zürich"}), ("get_time", {})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert parse_hermes("<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}")[0] is None  # cut before its end


@pytest.mark.parametrize("text", ["no calls here", "<tool_call>{not json}</tool_call>", "<tool_call>[1]</tool_call>",
                                  "text <tool_call>{\"arguments\": {}}</tool_call>"])
def test_a_text_without_whole_calls_is_answered_as_text(text):
    assert parse_hermes(text) == (text, [])


@pytest.mark.parametrize("cut", [1, 2, 5, 7, 13])
def test_a_stream_sends_the_text_before_the_calls_and_never_part_of_a_call(cut):
    stream = StreamedCalls()
    sent = "".join(stream.add(TEXT[i:i + cut]) for i in range(0, len(TEXT), cut))
    assert "<" not in sent and sent.strip() == "Let me look."
    assert stream.finish() == ""
    assert named(stream.calls) == named(parse_hermes(TEXT)[1])


def test_a_stream_without_calls_holds_back_only_what_could_start_one():
    stream = StreamedCalls()
    assert stream.add("a < b and <tool") == "a < b and "
    assert stream.add("box>") == "<toolbox>"
    assert stream.add(" end <") == " end "
    assert stream.finish() == "<" and stream.calls == []
