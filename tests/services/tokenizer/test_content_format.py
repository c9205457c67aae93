"""Messages' content given to chat templates as text or as text parts (vLLM's
--chat-template-content-format): a template that loops over a message's content gets the parts, as
transformers gives a list it is handed; any other gets them joined by newlines, as vLLM joins them."""
from __future__ import annotations

import json

import pytest

from protos import common_pb2, tokenizer_pb2
from services.tokenizer.chat_template import ChatOptions, ChatTemplate, ChatTemplateError
from services.tokenizer.content_format import content_chars
from services.tokenizer.converters import chat_message_to_proto, chat_messages_from_proto, chat_template_request
from tests.services.tokenizer.conftest import load_hf_tokenizer, load_tokenizer, shared_model_dir

# Gemma 3's way with content (its template, cut to the part that reads messages): a text as it is,
# or each text part trimmed, the parts written one after another.
PARTS_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] | trim }}"
    "{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
TEXT_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
PARTS = [{"type": "text", "text": "  Warm today?  "}, {"type": "text", "text": "In Zürich, I mean."}]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PARTS}]


@pytest.mark.parametrize("source, expected", [
    (PARTS_TEMPLATE, "openai"),
    (TEXT_TEMPLATE, "string"),
    ("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% set parts = m['content'] %}{% for p in parts %}{{ p.text }}{% endfor %}"
     "{% endfor %}", "openai"),
    ("{% for m in messages %}{% for p in m['content'] | selectattr('type', 'eq', 'text') %}{{ p.text }}"
     "{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% for k in m %}{{ k }}{% endfor %}{{ m['content'] }}{% endfor %}", "string"),
])
def test_auto_reads_whether_the_template_loops_over_a_messages_content(source, expected):
    assert ChatTemplate(source).content_format == expected


def test_the_shared_models_templates_read_text():
    for name in ("tiny-llama2-spm", "tiny-qwen2.5-bpe"):
        assert load_tokenizer(shared_model_dir(name)).chat_template().content_format == "string"


def test_parts_go_to_a_template_that_loops_over_them_as_transformers_gives_them():
    model_dir = shared_model_dir("tiny-qwen2.5-bpe")
    hf, tok = load_hf_tokenizer(model_dir), load_tokenizer(model_dir)
    for messages in (MESSAGES, [{"role": "user", "content": "  Warm today?  "}]):
        expected = hf.apply_chat_template(messages, chat_template=PARTS_TEMPLATE, add_generation_prompt=True,
                                          tokenize=False)
        text, ids = tok.apply_chat_template(messages, chat_template=PARTS_TEMPLATE)
        assert text == expected
        assert ids == hf(expected, add_special_tokens=False)["input_ids"]
    assert "<start_of_turn>user\nWarm today?In Zürich, I mean.<end_of_turn>" in text_of(tok, MESSAGES)
    # Given as text, a message is one part: the same prompt as text.
    as_text = [MESSAGES[0], {"role": "user", "content": "Warm today?"}]
    assert text_of(tok, as_text, content_format="openai") == text_of(tok, as_text, content_format="string")


def text_of(tok, messages, **options) -> str:
    return tok.apply_chat_template(messages, chat_template=PARTS_TEMPLATE, **options)[0]


def test_a_template_reading_text_gets_the_parts_joined_by_newlines():
    template = ChatTemplate(TEXT_TEMPLATE)
    assert template.render(MESSAGES) == "<|system|>Be brief.\n<|user|>  Warm today?  \nIn Zürich, I mean.\n"
    assert template.render(MESSAGES) == template.render(
        [MESSAGES[0], {"role": "user", "content": "  Warm today?  \nIn Zürich, I mean."}])


def test_a_format_given_replaces_what_the_template_reads():
    parts = ChatTemplate(PARTS_TEMPLATE)
    joined = parts.render(MESSAGES, content_format="string")
    assert "<start_of_turn>user\nWarm today?  \nIn Zürich, I mean.<end_of_turn>" in joined  # one text, trimmed once
    assert parts.render(MESSAGES, content_format="openai") == parts.render(MESSAGES) != joined
    listed = ChatTemplate(TEXT_TEMPLATE).render([{"role": "user", "content": "hi"}], content_format="openai")
    assert listed == "<|user|>[{'type': 'text', 'text': 'hi'}]\n"  # what the template asked for
    with pytest.raises(ChatTemplateError, match="content format must be one of auto, string, openai"):
        parts.render(MESSAGES, content_format="list")


def test_the_reply_continues_the_last_part_as_transformers_cuts_it():
    model_dir = shared_model_dir("tiny-qwen2.5-bpe")
    hf, tok = load_hf_tokenizer(model_dir), load_tokenizer(model_dir)
    messages = [*MESSAGES, {"role": "assistant", "content": [{"type": "text", "text": "Yes:"},
                                                             {"type": "text", "text": "it is 21"}]}]
    expected = hf.apply_chat_template(messages, chat_template=PARTS_TEMPLATE, continue_final_message=True,
                                      tokenize=False)
    text, _ = tok.apply_chat_template(messages, chat_template=PARTS_TEMPLATE, add_generation_prompt=False,
                                      continue_final_message=True)
    assert text == expected and text.endswith("<start_of_turn>assistant\nYes:it is 21")


def test_a_part_that_is_not_text_is_refused():
    for part in ({"type": "image_url", "image_url": {"url": "x"}}, {"type": "text"}, "text"):
        for source in (PARTS_TEMPLATE, TEXT_TEMPLATE):
            with pytest.raises(ChatTemplateError, match="a content part must be"):
                ChatTemplate(source).render([{"role": "user", "content": [part]}])


def test_parts_cross_the_tokenizer_service_as_parts():
    message = {"role": "user", "content": PARTS}
    proto = chat_message_to_proto(message)
    assert proto.content == "" and list(proto.content_parts) == [p["text"] for p in PARTS]
    assert chat_messages_from_proto([proto]) == [message]
    assert chat_messages_from_proto([common_pb2.ChatMessage(role="user", content="hi")])[0]["content"] == "hi"
    request = chat_template_request("r", MESSAGES, ChatOptions(content_format="string"))
    assert request.content_format == "string"
    assert tokenizer_pb2.ApplyChatTemplateRequest.FromString(request.SerializeToString()) == request
    assert content_chars(PARTS) == sum(len(p["text"]) for p in PARTS) and content_chars(None) == 0
    assert json.loads(json.dumps(chat_messages_from_proto(request.messages))) == MESSAGES
