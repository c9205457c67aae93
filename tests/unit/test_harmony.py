"""gpt-oss's harmony replies read as vLLM reads them (`--reasoning-parser openai_gptoss`,
`--tool-call-parser openai`): the analysis channel is reasoning, the final channel and preambles
are content, messages to `functions.NAME` are calls; whole, and streamed however the text is cut.
The texts are as gpt-oss writes them after its prompt's `<|start|>assistant`, its stop token
(`<|return|>` or `<|call|>`) left out, as the text leaves it out."""
from __future__ import annotations

import json

import pytest

from services.gateway.deltas import Delta, Usage
from services.gateway.harmony import HarmonyReasoning
from services.gateway.openai_responses import ResponseBuilder
from services.gateway.reasoning_parsers import ReasoningReader, reasoning_reader
from services.gateway.tool_parsers import PARSERS

THINK = "<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|>"
ANSWER = "<|start|>assistant<|channel|>final<|message|>It is 4."
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
        '<|message|>{"city": "Paris"}')
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Checking the weather.<|end|>"

# (text, reasoning, content, calls as (name, arguments))
CASES = [
    (THINK + ANSWER, "User asks 2+2. Easy.", "It is 4.", []),
    (THINK + CALL, "User asks 2+2. Easy.", None, [("get_weather", '{"city": "Paris"}')]),
    (THINK + PREAMBLE + CALL, "User asks 2+2. Easy.", "Checking the weather.", [("get_weather", '{"city": "Paris"}')]),
    # The recipient after the role, the content type after the channel, and no analysis first.
    (' to=functions.get_time<|channel|>commentary json<|message|>{"zone":"UTC"}', None, None,
     [("get_time", '{"zone":"UTC"}')]),
    ("<|channel|>final<|message|>Hi.", None, "Hi.", []),
    ("Just text, as a guided reply writes it.", None, "Just text, as a guided reply writes it.", []),
    ("<|channel|>analysis<|message|>Still think", "Still think", None, []),  # cut short while thinking
    (THINK + "<|start|>assistant<|chan", "User asks 2+2. Easy.", None, []),  # cut short in a header
    # A built-in tool this server does not run: the model's working, so reasoning.
    (THINK + '<|start|>assistant<|channel|>analysis to=browser.search code<|message|>{"query": "x"}<|call|>',
     'User asks 2+2. Easy.{"query": "x"}', None, []),
]


def builder() -> ResponseBuilder:
    return ResponseBuilder(kind="chat", response_id="r", model="m", num_choices=1, prompt_of_choice=[0],
                           token_text=str, want_logprobs=False, tool_call_syntax=PARSERS["openai"],
                           reasoning=ReasoningReader("openai_gptoss", decode=lambda ids: "<|start|>assistant"))


def deltas(pieces: list[str]) -> list[Delta]:
    last = len(pieces) - 1
    return [Delta(piece, [i], prompt_token_ids=[7] if i == 0 else (),
                  finish_reason="stop" if i == last else None, usage=Usage(1, len(pieces), 0) if i == last else None)
            for i, piece in enumerate(pieces)]


def whole(text: str) -> dict:
    response = builder()
    for delta in deltas([text]):
        response.add(0, delta)
    return response.whole()["choices"][0]


def streamed(pieces: list[str]) -> tuple[str, str, list[tuple[str, str]], str]:
    """(reasoning, content, calls, finish reason) of the chunks of a stream cut into `pieces`."""
    response, reasoning, content, calls, reason = builder(), "", "", {}, None
    for delta in deltas(pieces):
        choice = response.chunk(0, delta, include_usage=False)["choices"][0]
        reasoning += choice["delta"].get("reasoning") or ""
        content += choice["delta"].get("content") or ""
        for call in choice["delta"].get("tool_calls") or []:
            name, arguments = calls.get(call["index"], ("", ""))
            calls[call["index"]] = (name + (call["function"].get("name") or ""),
                                    arguments + (call["function"].get("arguments") or ""))
        reason = choice["finish_reason"] or reason
    return reasoning, content, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("text, reasoning, content, calls", CASES)
def test_whole_replies_read_by_channel_and_recipient(text, reasoning, content, calls):
    choice = whole(text)
    message = choice["message"]
    assert (message.get("reasoning"), message["content"]) == (reasoning, content)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == calls
    assert choice["finish_reason"] == ("tool_calls" if calls else "stop")
    for call in calls:
        json.loads(call[1])


@pytest.mark.parametrize("text, reasoning, content, calls", CASES)
@pytest.mark.parametrize("cut", [1, 3, 7])
def test_every_stream_of_a_reply_adds_up_to_its_whole(text, reasoning, content, calls, cut):
    """However the text is cut, no marker reaches the client in pieces, and the stream says what the
    whole reply does."""
    pieces = [text[i:i + cut] for i in range(0, len(text), cut)]
    said_reasoning, said_content, said_calls, reason = streamed(pieces)
    assert said_reasoning == (reasoning or "")
    if calls:
        assert said_calls == calls and reason == "tool_calls"
        assert said_content.strip() == (content or "")
    else:
        assert said_content == (content or "") and reason == "stop"


def test_arguments_cut_short_are_no_call_whole_and_stay_as_far_as_they_got_streamed():
    """As other parsers answer them: the whole reply is its text; a stream that sent the call keeps it."""
    text = THINK + '<|start|>assistant<|channel|>commentary to=functions.f<|message|>{"a": '
    message = whole(text)["message"]
    assert message["content"] == '<|channel|>commentary to=functions.f<|message|>{"a": '
    assert message["tool_calls"] == []
    assert streamed([text[i:i + 5] for i in range(0, len(text), 5)])[2] == [("f", '{"a": ')]


def test_a_markers_pieces_are_held_until_the_next_delta_says():
    stream = HarmonyReasoning()
    assert stream.add("<|chan") == ("", "") and stream.is_thinking is None
    assert stream.add("nel|>analysis<|message|>Hmm <|e") == ("Hmm ", "") and stream.is_thinking
    assert stream.add("nd|><|start|>assistant<|channel|>final<|message|>4") == ("", "4")
    assert stream.is_thinking is False and stream.has_thought
    assert stream.add(" <|re") == ("", " ") and stream.finish() == ("", "<|re")


def test_the_tokens_of_the_analysis_channel_are_reasoning_tokens():
    pieces = ["<|channel|>", "analysis", "<|message|>", "Two", " and two", "<|end|>", "<|start|>", "assistant",
              "<|channel|>", "final", "<|message|>", "4"]
    response = builder()
    for delta in deltas(pieces):
        response.chunk(0, delta, include_usage=False)
    assert response.reasoning_tokens == 6  # its header, its text and its <|end|>


class Tokens:
    """What the reader asks of a tokenizer, with or without harmony's markers as tokens of their own
    (gpt-oss's ids)."""

    def __init__(self, has_markers: bool) -> None:
        self.ids = {"<|channel|>": 200005, "<|message|>": 200008} if has_markers else {}

    def token_to_id(self, token: str) -> int | None:
        return self.ids.get(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [17196] if text == "final" else [1, 2, 3]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "<|start|>assistant"


def test_a_guided_reply_is_guided_from_the_final_channel_where_the_markers_are_tokens():
    """As vLLM guides a gpt-oss reply: its analysis free, the guide holding from the token after
    `<|channel|>final<|message|>`; without those tokens, from the first token (all answer)."""
    guided = reasoning_reader("openai_gptoss", Tokens(has_markers=True), is_guided=True)
    assert guided.reads_special_tokens and guided.guide_after([7, 8]) == (200005, 17196, 200008)
    assert reasoning_reader("openai_gptoss", Tokens(has_markers=True), is_guided=False).guide_after([7]) is None
    assert reasoning_reader("openai_gptoss", Tokens(has_markers=False), is_guided=True).guide_after([7]) is None
    assert not reasoning_reader("qwen3", Tokens(has_markers=True), is_guided=True).reads_special_tokens
