"""Reasoning parsers: a reply's thinking apart from its answer, whole and streamed however the
text is cut, the tokens it thought for, and how the prompt and the guide decide where a reply
starts."""
from __future__ import annotations

import pytest

from services.gateway.chat_messages import ChatMessage
from services.gateway.deltas import Delta, Usage
from services.gateway.openai_responses import ResponseBuilder
from services.gateway.reasoning_parsers import TAGS, THINK, ReasoningReader, StreamedReasoning, starts_thinking
from services.tokenizer.converters import chat_message_to_proto, chat_messages_from_proto

# (text, how it starts, reasoning, content)
CASES = [
    ("<think>Sum it up.</think>\n\nIt is 4.", None, "Sum it up.", "\n\nIt is 4."),
    ("  <think>a</think>b", None, "a", "b"),
    ("It is 4.", None, None, "It is 4."),
    ("It is <think> 4.", None, None, "It is <think> 4."),  # a tag after the start opens nothing
    ("Sum it up.</think>It is 4.", True, "Sum it up.", "It is 4."),
    ("Sum it up, and", True, "Sum it up, and", None),  # cut short while thinking
    ("<think>Sum</think>", True, "Sum", None),  # an opening tag written again is dropped
    ("Sum </thi", True, "Sum </thi", None),  # a tag never finished is text
    ("<thin", None, None, "<thin"),
    ("", None, None, ""),
    ("a</think>b</think>c", True, "a", "b</think>c"),  # only the first closes the thinking
]


def chat_builder(start: bool | None) -> ResponseBuilder:
    """A chat response whose replies start thinking (deepseek_r1) or as their text says (qwen3, a
    prompt with no think block)."""
    reader = ReasoningReader("deepseek_r1" if start else "qwen3", decode=lambda ids: "<|im_start|>assistant\n")
    return ResponseBuilder(kind="chat", response_id="r", model="m", num_choices=1, prompt_of_choice=[0],
                           token_text=str, want_logprobs=False, reasoning=reader)


def deltas(pieces: list[str]) -> list[Delta]:
    """One token a piece, the last finishing the reply."""
    last = len(pieces) - 1
    return [Delta(piece, [i], prompt_token_ids=[7] if i == 0 else (),
                  finish_reason="stop" if i == last else None, usage=Usage(1, len(pieces), 0) if i == last else None)
            for i, piece in enumerate(pieces)]


@pytest.mark.parametrize("text, start, reasoning, content", CASES)
def test_whole_replies_split_at_the_closing_tag(text, start, reasoning, content):
    builder = chat_builder(start)
    for delta in deltas([text]):
        builder.add(0, delta)
    message = builder.whole()["choices"][0]["message"]
    assert (message.get("reasoning"), message["content"]) == (reasoning, content)


def test_the_tokens_a_reply_thought_for_are_counted_whole_and_streamed():
    pieces = ["<th", "ink>", "Sum", " it", "</", "think>", "It is", " 4."]  # tags spelled in pieces
    whole, streamed = chat_builder(None), chat_builder(None)
    for delta in deltas(pieces):
        whole.add(0, delta)
        streamed.chunk(0, delta, include_usage=False)
    for builder in (whole, streamed):  # the opening and closing tags' tokens count as thinking
        assert builder.usage["completion_tokens_details"] == {"reasoning_tokens": 6}
    answer_only = chat_builder(None)
    for delta in deltas(["<", "b>", "bold</b>"]):  # not a think block after all
        answer_only.add(0, delta)
    assert answer_only.usage["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert whole.whole()["choices"][0]["message"]["reasoning"] == "Sum it"
    plain = ResponseBuilder(kind="chat", response_id="r", model="m", num_choices=1, prompt_of_choice=[0],
                            token_text=str, want_logprobs=False)
    for delta in deltas(["It is 4."]):
        plain.add(0, delta)
    assert "completion_tokens_details" not in plain.usage  # no parser, no count


def chunks(pieces: list[str], size: int) -> list[Delta]:
    """`size` tokens a delta (a piece a token, its id its index), the last finishing the reply."""
    starts = range(0, len(pieces), size)
    return [Delta("".join(pieces[a:a + size]), list(range(a, min(a + size, len(pieces)))),
                  prompt_token_ids=[7] if a == 0 else (), finish_reason="stop" if a == starts[-1] else None,
                  usage=Usage(1, len(pieces), 0) if a == starts[-1] else None) for a in starts]


@pytest.mark.parametrize("size", [2, 3, 5, 8])
def test_tokens_that_come_together_are_counted_as_if_each_came_alone(size):
    """A chunk of several tokens that ends the thinking: its tokens up to the one completing the end
    are thinking's, the rest the answer's, found by the end's token where the tokenizer has one, else
    by the answer's text."""
    pieces = ["<th", "ink>", "Sum", " it", "</", "think>", "It is", " 4."]  # thinking: the first 6
    spelled = ReasoningReader("qwen3", decode=lambda ids: "<|im_start|>assistant\n",
                              decode_text=lambda ids: "".join(pieces[i] for i in ids))
    marked = ["<think>", "Sum", " it", "</think>", "It", " is", " 4", "."]  # "</think>" is token 3
    as_token = ReasoningReader("qwen3", decode=lambda ids: "<|im_start|>assistant\n", end_token_ids=(3,),
                               decode_text=lambda ids: "")  # (never asked: the end is found by its id)
    for reader, text, expected in ((spelled, pieces, 6), (as_token, marked, 4)):
        builder = ResponseBuilder(kind="chat", response_id="r", model="m", num_choices=1, prompt_of_choice=[0],
                                  token_text=str, want_logprobs=False, reasoning=reader)
        for delta in chunks(text, size):
            builder.add(0, delta)
        assert builder.usage["completion_tokens_details"] == {"reasoning_tokens": expected}


SEED_OSS = TAGS["seed_oss"]


@pytest.mark.parametrize("tags", [THINK, SEED_OSS], ids=["think", "seed_oss"])
@pytest.mark.parametrize("text, start, reasoning, content", CASES)
def test_a_stream_cut_anywhere_sends_what_the_whole_reply_gives(text, start, reasoning, content, tags):
    if tags is SEED_OSS:  # the same cases in Seed-OSS's tags
        text, reasoning, content = (x and x.replace("<think>", tags.start).replace("</think>", tags.end)
                                    for x in (text, reasoning, content))
    for cuts in [(i,) for i in range(len(text) + 1)] + [(i, j) for i in range(len(text)) for j in range(i, len(text))]:
        stream = StreamedReasoning(start, tags)
        pieces = [text[a:b] for a, b in zip((0, *cuts), (*cuts, len(text)))]
        sent = [stream.add(piece) for piece in pieces] + [stream.finish()]
        thought, answer = "".join(t for t, _ in sent), "".join(a for _, a in sent)
        assert (thought if stream.has_thought else None) == reasoning, (cuts, sent)
        assert answer == (content or ""), (cuts, sent)


# Step-3.5's and 3.7's replies (their template opens the thinking): (text, reasoning, content), trailing whitespace
# of the thinking dropped, whatever follows it.
STEP3P5_CASES = [
    ("Sum it up.\n</think>\nIt is 4.", "Sum it up.", "\nIt is 4."),
    ("Sum  it \n \n</think>", "Sum  it", ""),
    ("a \n b\n", "a \n b", None),  # cut short while thinking
    ("<think>a\n</think>b", "a", "b"),
    ("\n</think>b \n", "", "b \n"),
]


@pytest.mark.parametrize("text, reasoning, content", STEP3P5_CASES)
def test_step3p5s_thinking_drops_its_trailing_whitespace_however_the_stream_is_cut(text, reasoning, content):
    assert starts_thinking("step3p5", "", False) is True
    for cuts in [(i,) for i in range(len(text) + 1)] + [(i, j) for i in range(len(text)) for j in range(i, len(text))]:
        stream = ReasoningReader("step3p5", decode=lambda ids: "").stream([])
        pieces = [text[a:b] for a, b in zip((0, *cuts), (*cuts, len(text)))]
        sent = [stream.add(piece) for piece in pieces] + [stream.finish()]
        assert "".join(t for t, _ in sent) == reasoning, (cuts, sent)
        assert "".join(a for _, a in sent) == (content or ""), (cuts, sent)


def test_a_stream_holds_back_only_what_may_still_be_a_tag():
    stream = StreamedReasoning(True)
    assert stream.add("Thinking </th") == ("Thinking ", "")
    assert stream.add("ink>Done") == ("", "Done")
    assert stream.add(" </th") == ("", " </th")  # answering now: nothing is held
    undecided = StreamedReasoning(None)
    assert undecided.add(" <th") == ("", "")
    assert undecided.add("ere") == ("", " <there")


def test_where_a_reply_starts():
    opened, closed = "<|im_start|>assistant\n<think>\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert starts_thinking("qwen3", "<|im_start|>assistant\n", is_guided_from_start=False) is None
    assert starts_thinking("qwen3", opened, is_guided_from_start=False) is True  # the template opened it
    assert starts_thinking("qwen3", closed, is_guided_from_start=False) is None  # enable_thinking false
    # R1 may leave <think> out.
    assert starts_thinking("deepseek_r1", "<|Assistant|>", is_guided_from_start=False) is True
    assert starts_thinking("deepseek_r1", closed, is_guided_from_start=False) is None  # thinking switched off
    # A reply guided from its first token is the answer unless its own text opens a think block.
    assert starts_thinking("deepseek_r1", opened, is_guided_from_start=True) is None
    assert starts_thinking("qwen3", opened, is_guided_from_start=True) is None
    # GLM-4.5 reads as Qwen3: thinking only where a <think> opens it.
    glm = "<|assistant|>"
    assert starts_thinking("glm45", glm, is_guided_from_start=False) is None
    assert starts_thinking("glm45", glm + "<think>", is_guided_from_start=False) is True
    # Seed-OSS reads as Qwen3, in its own tags.
    assert starts_thinking("seed_oss", "<seed:bos>assistant\n", is_guided_from_start=False) is None
    assert starts_thinking("seed_oss", "assistant\n<seed:think>", is_guided_from_start=False) is True
    assert starts_thinking("seed_oss", "assistant\n<think>", is_guided_from_start=False) is None  # not its tag
    # DeepSeek-V3.1's template opens the thinking with `thinking` true, and closes it otherwise.
    for assistant in ("<｜Assistant｜><think>", "<｜Assistant｜></think>"):
        thinking = starts_thinking("deepseek_v3", assistant, is_guided_from_start=False)
        assert thinking is (True if assistant.endswith("<think>") else None)


def test_an_earlier_turns_thinking_reaches_the_template_by_either_name():
    for field in ("reasoning", "reasoning_content"):
        message = ChatMessage(role="assistant", content="4", **{field: "2 and 2"}).as_template_input()
        assert message == {"role": "assistant", "content": "4", "reasoning_content": "2 and 2"}
        [back] = chat_messages_from_proto([chat_message_to_proto(message)])
        assert back == message  # as the tokenizer service renders it
    assert "reasoning_content" not in ChatMessage(role="assistant", content="4").as_template_input()
