"""Tool-call parsers: calls out of a whole text, and out of a stream cut anywhere."""
from __future__ import annotations

import json

import pytest

from services.gateway.json_tool_calls import RequiredCalls
from services.gateway.streamed_calls import StreamedCalls
from services.gateway.tool_parsers import PARSERS, syntax_for

HERMES, LLAMA3, PYTHONIC, MISTRAL = (PARSERS[name] for name in ("hermes", "llama3_json", "pythonic", "mistral"))
HERMES_TEXT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
LLAMA3_TEXT = '{"name": "get_weather", "parameters": {"city": "Zürich"}}; {"name": "get_time", "parameters": {}}'
PYTHONIC_TEXT = '[get_weather(city="Zürich"), get_time()]'
MISTRAL_LISTED = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Zürich"}}, '
                  '{"name": "get_time", "arguments": {}}]')  # Mistral's tokenizer v3
MISTRAL_NAMED = ('Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}'
                 '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}')  # v11 and later
QWEN3_CODER, GLM45, SEED_OSS, MINIMAX_M2 = (PARSERS[name] for name in ("qwen3_coder", "glm45", "seed_oss",
                                                                         "minimax_m2"))
DEEPSEEK_V3, DEEPSEEK_V31, KIMI_K2 = PARSERS["deepseek_v3"], PARSERS["deepseek_v31"], PARSERS["kimi_k2"]
KIMI_K2_TEXT = ('Let me look.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
                '<|tool_call_argument_begin|>{"city": "Zürich"}<|tool_call_end|><|tool_call_begin|> '
                'functions.get_time:1 <|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>')
DEEPSEEK_V3_TEXT = ('Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n'
                    '```json\n{"city": "Zürich"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>'
                    'get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
DEEPSEEK_V31_TEXT = ('Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>'
                     '{"city": "Zürich"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}'
                     '<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
GLM45_TEXT = ("Let me look.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Zürich</arg_value>\n"
              "</tool_call><tool_call>get_time</tool_call>")
QWEN3_CODER_TEXT = ("Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n"
                    "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>")
SEED_OSS_TEXT = ("Let me look.\n<seed:tool_call>\n<function=get_weather>\n<parameter=city>Zürich</parameter>\n"
                 "</function>\n</seed:tool_call><seed:tool_call>\n<function=get_time>\n</function>\n</seed:tool_call>")
MINIMAX_M2_TEXT = ('Let me look.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Zürich'
                   '</parameter>\n</invoke>\n<invoke name="get_time">\n</invoke>\n</minimax:tool_call>')
REQUIRED, REQUIRED_TEXT = RequiredCalls(), ('[{"name": "get_weather", "parameters": {"city": "Zürich"}}, '
                                            '{"name": "get_time", "parameters": {}}]')  # tool_choice "required"
GRANITE, PHI4_MINI = PARSERS["granite"], PARSERS["phi4_mini_json"]
LISTED_CALLS = '[{"name": "get_weather", "arguments": {"city": "Zürich"}}, {"name": "get_time", "arguments": {}}]'
GRANITE_TEXT = "<tool_call>" + LISTED_CALLS  # Granite 3.1; 3.0's <|tool_call|> is a special token, left out
PHI4_MINI_TEXT = "Let me look. functools" + LISTED_CALLS
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
    assert REQUIRED.parse(REQUIRED_TEXT)[0] is None and named(REQUIRED.parse(REQUIRED_TEXT)[1]) == CALLS
    for text, said in ((MISTRAL_LISTED, None), (MISTRAL_NAMED, "Let me look.")):
        content, calls = MISTRAL.parse(text)
        assert content == said and named(calls) == CALLS
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)  # what Mistral's templates take
    for syntax, text, said in ((GRANITE, GRANITE_TEXT, None), (GRANITE, " " + LISTED_CALLS, None),
                               (PHI4_MINI, PHI4_MINI_TEXT, "Let me look.")):
        content, calls = syntax.parse(text)
        assert content == said and named(calls) == CALLS
    nested = PYTHONIC.parse('[f(n=1, xs=[1.5, None], on=True, by={"k": "v"})]')[1]
    assert named(nested) == [("f", {"n": 1, "xs": [1.5, None], "on": True, "by": {"k": "v"}})]


@pytest.mark.parametrize(("syntax", "text"), [
    (HERMES, "no calls here"), (HERMES, "<tool_call>{not json}</tool_call>"), (HERMES, "<tool_call>[1]</tool_call>"),
    (HERMES, 'text <tool_call>{"arguments": {}}</tool_call>'), (LLAMA3, "The weather is fine."),
    (LLAMA3, '{"name": "f", "parameters": {}} and then some'), (LLAMA3, '{"city": "Paris"}'),
    (PYTHONIC, "[1, 2]"), (PYTHONIC, "[f(1)]"), (PYTHONIC, "[f(x=y)]"), (PYTHONIC, "[f(**kw)]"), (PYTHONIC, "[]"),
    (PYTHONIC, "[f(x={1, 2})]"), (PYTHONIC, "[obj.f(x=1)]"), (PYTHONIC, "[f(x=1)] and more"), (PYTHONIC, "Sunny."),
    (MISTRAL, "Sunny."), (MISTRAL, "[TOOL_CALLS] [{not json}]"), (MISTRAL, '[TOOL_CALLS] [{"name": "f"}] more'),
    (MISTRAL, '[TOOL_CALLS] [{"arguments": {}}]'), (MISTRAL, "[TOOL_CALLS]f{}"), (MISTRAL, "[TOOL_CALLS][ARGS]{}"),
    (MISTRAL, "[TOOL_CALLS]f[ARGS]{oops}"), (GRANITE, "Sunny."), (GRANITE, "<tool_call>{}"),
    (GRANITE, '[{"name": "f", "arguments": {}}] and more'), (GRANITE, "Here: " + LISTED_CALLS),
    (PHI4_MINI, "Sunny."), (PHI4_MINI, "functools[{not json}]"), (PHI4_MINI, 'functools[{"arguments": {}}]'),
])
def test_a_text_without_whole_calls_is_answered_as_text(syntax, text):
    assert syntax.parse(text) == (text, [])


def streamed(syntax, pieces: list[str]) -> tuple[str, list[dict], StreamedCalls, int]:
    """The text a stream of `pieces` sends, its calls as a client adds their deltas up, the stream, and
    how many pieces had gone in when the first call's name came out (None: never before the end)."""
    stream, text, calls, named_after = StreamedCalls(syntax), "", {}, None

    def take(sent: str, deltas: list[dict]) -> None:
        nonlocal text
        text += sent
        assert len({d["index"] for d in deltas}) == len(deltas)  # one delta per call per chunk
        for delta in deltas:
            call = calls.setdefault(delta["index"], {"id": delta.get("id"), "name": delta["function"].get("name"),
                                                     "arguments": ""})
            assert delta.get("id") in (None, call["id"]) and call["id"] and call["name"]
            call["arguments"] += delta["function"].get("arguments", "")

    for i, piece in enumerate(pieces):
        take(*stream.add(piece))
        if calls and named_after is None:
            named_after = i + 1
    take(*stream.finish())
    return text, [calls[i] for i in sorted(calls)], stream, named_after


def as_whole(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def as_streamed(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["name"], c["arguments"]) for c in calls]


@pytest.mark.parametrize(("syntax", "text", "said"), [
    (HERMES, HERMES_TEXT, "Let me look."), (LLAMA3, LLAMA3_TEXT, ""), (PYTHONIC, PYTHONIC_TEXT, ""),
    (MISTRAL, MISTRAL_LISTED, ""), (MISTRAL, MISTRAL_NAMED, "Let me look."), (REQUIRED, REQUIRED_TEXT, ""),
    (QWEN3_CODER, QWEN3_CODER_TEXT, "Let me look."), (GLM45, GLM45_TEXT, "Let me look."),
    (SEED_OSS, SEED_OSS_TEXT, "Let me look."), (MINIMAX_M2, MINIMAX_M2_TEXT, "Let me look."),
    (DEEPSEEK_V3, DEEPSEEK_V3_TEXT, "Let me look."), (DEEPSEEK_V31, DEEPSEEK_V31_TEXT, "Let me look."),
    (KIMI_K2, KIMI_K2_TEXT, "Let me look."), (GRANITE, GRANITE_TEXT, ""), (GRANITE, LISTED_CALLS, ""),
    (PHI4_MINI, PHI4_MINI_TEXT, "Let me look.")])
@pytest.mark.parametrize("cut", [1, 2, 5, 7, 13])
def test_a_stream_sends_the_text_before_the_calls_and_never_part_of_a_call(syntax, text, said, cut):
    sent, calls, stream, _ = streamed(syntax, [text[i:i + cut] for i in range(0, len(text), cut)])
    assert not set("<{[") & set(sent) and sent.strip() == said
    assert named(stream.calls) == CALLS
    assert as_streamed(calls) == as_whole(stream.calls) == as_whole(syntax.parse(text)[1])
    assert [c["id"] for c in calls] == [c["id"] for c in stream.calls]


STREAMING = [(HERMES, HERMES_TEXT), (LLAMA3, LLAMA3_TEXT), (MISTRAL, MISTRAL_LISTED), (MISTRAL, MISTRAL_NAMED),
             (REQUIRED, REQUIRED_TEXT), (GRANITE, GRANITE_TEXT), (PHI4_MINI, PHI4_MINI_TEXT)]


@pytest.mark.parametrize(("syntax", "text"), [*STREAMING, (PYTHONIC, PYTHONIC_TEXT), (QWEN3_CODER, QWEN3_CODER_TEXT),
                                          (GLM45, GLM45_TEXT), (SEED_OSS, SEED_OSS_TEXT),
                                          (MINIMAX_M2, MINIMAX_M2_TEXT), (DEEPSEEK_V3, DEEPSEEK_V3_TEXT),
                                          (DEEPSEEK_V31, DEEPSEEK_V31_TEXT), (KIMI_K2, KIMI_K2_TEXT)])
def test_every_stream_of_a_reply_adds_up_to_its_calls(syntax, text):
    whole = as_whole(syntax.parse(text)[1])
    for a in range(len(text) + 1):
        for b in range(a, len(text) + 1, 3):
            sent, calls, _, _ = streamed(syntax, [text[:a], text[a:b], text[b:]])
            assert as_streamed(calls) == whole, (a, b)


@pytest.mark.parametrize(("syntax", "text"), STREAMING)
def test_a_call_streams_its_name_then_its_arguments_as_they_come(syntax, text):
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    _, _, _, named_after = streamed(syntax, pieces)
    name_end = text.index("get_weather") + len("get_weather") + 1
    arguments_end = text.index("Zürich") + len("Zürich")
    assert named_after is not None and named_after * 3 < arguments_end  # named before its arguments are whole
    stream = StreamedCalls(syntax)
    stream.add(text[:name_end + 20])
    _, deltas = stream.add(text[name_end + 20:arguments_end])
    assert deltas == [{"index": 0, "function": {"arguments": text[name_end + 20:arguments_end]}}]


def test_a_pythonic_call_goes_out_whole_once_its_parenthesis_closes():
    """A Python call's arguments are JSON only once parsed: each call goes out whole as it closes (a `)`
    inside a string or a nested tuple does not close it), not all of them at the end of the list."""
    text = '[get_weather(city="Zü)rich", at=(1, 2)), get_time(zone=\'U)TC\')]'
    first_closed = text.index(")),") + 2
    stream = StreamedCalls(PYTHONIC)
    assert stream.add(text[:first_closed - 1]) == ("", [])
    sent, deltas = stream.add(text[first_closed - 1:first_closed + 12])
    assert sent == "" and [(d["index"], d["function"]["name"], d["function"]["arguments"]) for d in deltas] == [
        (0, "get_weather", '{"city": "Zü)rich", "at": [1, 2]}')]
    assert stream.add(text[first_closed + 12:-2]) == ("", [])  # the second's `)` is in its string
    _, deltas = stream.add(text[-2:])
    assert [(d["index"], d["function"]["name"]) for d in deltas] == [(1, "get_time")]
    assert stream.finish() == ("", []) and as_whole(stream.calls) == as_whole(PYTHONIC.parse(text)[1])


def test_arguments_are_the_json_the_model_wrote():
    text = '<tool_call>{"name": "f", "arguments": {"a":1,  "b": ["x", {"c": "}"}]}}</tool_call>'
    assert as_whole(HERMES.parse(text)[1]) == [("f", '{"a":1,  "b": ["x", {"c": "}"}]}')]
    assert as_streamed(streamed(HERMES, list(text))[1]) == [("f", '{"a":1,  "b": ["x", {"c": "}"}]}')]
    quoted = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'  # arguments as a JSON string
    assert as_whole(HERMES.parse(quoted)[1]) == [("f", '{"a": 1}')]
    assert as_streamed(streamed(HERMES, list(quoted))[1]) == [("f", '{"a": 1}')]


def test_a_call_written_name_last_goes_out_whole_once_it_is():
    text = '{"parameters": {"city": "Paris"}, "name": "get_weather"}'
    sent, calls, stream, named_after = streamed(LLAMA3, list(text))
    assert sent == "" and named_after is None
    assert as_streamed(calls) == [("get_weather", '{"city": "Paris"}')] == as_whole(stream.calls)


def test_calls_broken_after_one_went_out_stay_as_far_as_they_got():
    text = ('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
            '<tool_call>{"name": "g", "arguments": {"b": oops}')
    assert HERMES.parse(text) == (text, [])  # whole: text
    sent, calls, stream, _ = streamed(HERMES, [text[:30], text[30:]])
    assert sent == ""
    assert as_streamed(calls) == as_whole(stream.calls) == [("f", '{"a": 1}'), ("g", '{"b": oops}')]
    unnamed = "<tool_call>{not json}</tool_call>"  # no call went out: the reply is text, as whole
    sent, calls, stream, _ = streamed(HERMES, list(unnamed))
    assert (sent, calls, stream.calls) == (unnamed, [], [])


def test_a_stream_without_calls_holds_back_only_what_could_start_one():
    stream = StreamedCalls(HERMES)
    assert stream.add("a < b and <tool") == ("a < b and ", [])
    assert stream.add("box>") == ("<toolbox>", [])
    assert stream.add(" end <") == (" end ", [])
    assert stream.finish() == ("<", []) and stream.calls == []
    llama = StreamedCalls(LLAMA3)
    assert llama.add(" ") == ("", [])  # a call may still come
    assert llama.add("Sunny, ") == (" Sunny, ", [])
    assert llama.add('{"json": "later is text"}') == ('{"json": "later is text"}', [])
    assert llama.finish() == ("", []) and llama.calls == []


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "celsius": {"type": "boolean"},
    "ratio": {"type": "number"}, "hours": {"type": "array"}, "where": {"type": "object"}, "note": {"type": "string"},
    "code": {"type": "string"}, "spare": {"type": ["integer", "null"]}}}}}


def test_qwen3_coder_arguments_take_their_types_from_the_request_tools():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=celsius>\nTrue\n</parameter>\n"
            "<parameter=ratio>\n0.5\n</parameter>\n<parameter=hours>\n[9, 17]\n</parameter>\n"
            "<parameter=where>\n{'lat': -23.5, 'on': True}\n</parameter>\n<parameter=note>\n42\n</parameter>\n"
            "<parameter=code>\nline one\n  line two\n</parameter>\n<parameter=spare>\nnull\n</parameter>\n"
            "<parameter=unknown>\n7\n</parameter>\n</function>\n</tool_call>")
    (call,) = syntax_for("qwen3_coder", [WEATHER_TOOL]).parse(text)[1]
    assert json.loads(call["function"]["arguments"]) == {
        "city": "São Paulo", "days": 3, "celsius": True, "ratio": 0.5, "hours": [9, 17],
        "where": {"lat": -23.5, "on": True}, "note": "42", "code": "line one\n  line two", "spare": None,
        "unknown": "7"}  # a parameter the tool does not declare stays text, as vLLM's
    # Without the request's tools every value is text; a value that does not parse as its type stays text.
    assert json.loads(QWEN3_CODER.parse(text)[1][0]["function"]["arguments"])["days"] == "3"
    odd = text.replace("\n3\n", "\nthree\n")
    assert json.loads(syntax_for("qwen3_coder", [WEATHER_TOOL]).parse(odd)[1][0]["function"]["arguments"])[
        "days"] == "three"


@pytest.mark.parametrize("text", ["no calls", "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n",
                                  "<tool_call>\n</tool_call>"])
def test_a_qwen3_coder_text_without_whole_calls_is_text(text):
    assert QWEN3_CODER.parse(text) == (text, [])


def test_a_qwen3_coder_call_is_named_first_and_its_arguments_go_out_whole():
    stream = StreamedCalls(syntax_for("qwen3_coder", [WEATHER_TOOL]))
    assert stream.add("Sure.\n<tool_") == ("Sure.\n", [])
    sent, deltas = stream.add("call>\n<function=get_weather>\n<parameter=days>\n2")
    assert sent == "" and deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert stream.add("\n</parameter>\n") == ("", [])
    _, deltas = stream.add("</function>\n</tool_call>")
    assert deltas == [{"index": 0, "function": {"arguments": '{"days": 2}'}}]


def test_minimax_m2_and_seed_oss_arguments_are_typed_as_qwen3_coders():
    """The same parameters in each one's tags: the same typed arguments."""
    values = {"city": "São Paulo", "days": "3", "celsius": "true", "hours": "[9, 17]", "note": "42", "spare": "null",
              "code": "line one\n  line two"}
    expected = {"city": "São Paulo", "days": 3, "celsius": True, "hours": [9, 17], "note": "42", "spare": None,
                "code": "line one\n  line two"}
    minimax = "".join(f'<parameter name="{k}">\n{v}\n</parameter>\n' for k, v in values.items())
    seed = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    for parser, text in (("minimax_m2", f'<minimax:tool_call>\n<invoke name="get_weather">\n{minimax}</invoke>\n'
                                        "</minimax:tool_call>"),
                         ("seed_oss", f"<seed:tool_call>\n<function=get_weather>\n{seed}</function>\n"
                                      "</seed:tool_call>"),
                         ("qwen3_coder", f"<tool_call>\n<function=get_weather>\n{seed}</function>\n</tool_call>")):
        (call,) = syntax_for(parser, [WEATHER_TOOL]).parse(text)[1]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == expected, parser
    for text in ('<minimax:tool_call>\n<invoke name="f">\n<parameter name="a">1</parameter>\n',  # cut short
                 '<minimax:tool_call>\n<invoke name="">\n</invoke>', "<seed:tool_call>\n</seed:tool_call>"):
        assert syntax_for("minimax_m2" if "minimax" in text else "seed_oss", None).parse(text) == (text, [])


def test_glm45_arguments_are_text_where_the_tool_says_string_and_parsed_elsewhere():
    text = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value> 42 </arg_value>"  # GLM-4.7's, no newlines
            "<arg_key>days</arg_key>\\n<arg_value>3</arg_value><arg_key>hours</arg_key><arg_value>[9, 17]</arg_value>"
            "<arg_key>where</arg_key><arg_value>{'on': True}</arg_value><arg_key>note</arg_key>"
            "<arg_value>not json</arg_value></tool_call>")
    (call,) = syntax_for("glm45", [WEATHER_TOOL]).parse(text)[1]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "42", "days": 3, "hours": [9, 17],
                                                         "where": {"on": True}, "note": "not json"}
    assert GLM45.parse("<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>")[1] == []  # no name
    assert GLM45.parse("<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value>")[1] == []  # cut short


def test_deepseek_calls_keep_the_models_json_and_broken_ones_are_text():
    (call,) = DEEPSEEK_V31.parse('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"a": [1,2]}'
                                 '<｜tool▁call▁end｜>')[1]
    assert call["function"] == {"name": "f", "arguments": '{"a": [1,2]}'}  # its own spacing kept
    for text in ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"a": 1',  # cut short
                 '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{oops}<｜tool▁call▁end｜>'):
        assert DEEPSEEK_V31.parse(text) == (text, [])
    assert DEEPSEEK_V3.parse("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n{}"
                             "<｜tool▁call▁end｜>")[1] == []  # no ```json fence
    assert DEEPSEEK_V3.reads_special_tokens and DEEPSEEK_V31.reads_special_tokens


def test_a_kimi_call_is_named_by_its_function_and_an_unindexed_one_is_text():
    text = '<|tool_calls_section_begin|><|tool_call_begin|>functions.search_web:3<|tool_call_argument_begin|>{"q": 1}'
    (call,) = KIMI_K2.parse(text + "<|tool_call_end|>")[1]
    assert call["function"] == {"name": "search_web", "arguments": '{"q": 1}'} and call["id"].startswith("call_")
    unindexed = text.replace(":3", "") + "<|tool_call_end|>"
    assert KIMI_K2.parse(unindexed) == (unindexed, [])
