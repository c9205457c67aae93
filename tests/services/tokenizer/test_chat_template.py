"""Chat prompts must be the very ids transformers' apply_chat_template gives."""
from __future__ import annotations

import json

import pytest

from services.tokenizer.chat_template import ChatTemplate, ChatTemplateError
from tests.services.tokenizer.conftest import load_hf_tokenizer, load_tokenizer, shared_model_dir

CONVERSATIONS = {
    "single user": [{"role": "user", "content": "Hello, who are you?"}],
    "system + user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime number."},
    ],
    "multi-turn": [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Japan?"},
        {"role": "assistant", "content": " Tokyo. "},
        {"role": "user", "content": "Thanks!"},
    ],
    "unicode": [
        {"role": "user", "content": "Ça va? 你好，世界 🌍🚀 naïve café — “quotes” ñ 日本語 👩‍👩‍👧"},
        {"role": "assistant", "content": "Très bien 😀"},
        {"role": "user", "content": "  leading and trailing spaces\n\nand newlines  "},
    ],
    "none-valued keys": [{"role": "user", "content": "hi", "name": None, "tool_calls": None}],
}


def _hf_ids(model_dir, messages, **kwargs) -> list[int]:
    out = load_hf_tokenizer(model_dir).apply_chat_template(messages, tokenize=True,
                                                           **{"add_generation_prompt": True, **kwargs})
    # transformers 5 returns a BatchEncoding by default (return_dict=True).
    return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_ids_equal_transformers(model_dir, tok, name):
    messages = CONVERSATIONS[name]
    text, ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert ids == _hf_ids(model_dir, messages)
    assert ids == tok.encode(text, add_special_tokens=False)


def test_text_equals_transformers(model_dir, tok):
    hf = load_hf_tokenizer(model_dir)
    for messages in CONVERSATIONS.values():
        for add_generation_prompt in (True, False):
            expected = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
            assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)[0] == expected


@pytest.mark.parametrize("name", ["multi-turn", "unicode"])
def test_continue_final_message_cuts_as_transformers_does(model_dir, tok, name):
    # The reply continues a prefilled assistant turn (one with trailing spaces the template may strip).
    for partial in ("The answer is", "Well,  "):
        messages = [*CONVERSATIONS[name], {"role": "assistant", "content": partial}]
        hf = load_hf_tokenizer(model_dir).apply_chat_template(messages, add_generation_prompt=False,
                                                              continue_final_message=True, tokenize=False)
        text, ids = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
        assert text == hf
        assert text.rstrip().endswith(partial.rstrip())
        assert ids == _hf_ids(model_dir, messages, continue_final_message=True, add_generation_prompt=False)


def test_continue_final_message_refusals(demo_model_dir):
    tok = load_tokenizer(demo_model_dir)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    with pytest.raises(ChatTemplateError, match="cannot both be set"):
        tok.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)
    no_text = ChatTemplate("{% for m in messages %}{{ m.role }}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="nothing to continue"):
        no_text.render(messages, add_generation_prompt=False, continue_final_message=True)


def test_template_kwargs_reach_the_template_as_in_transformers(demo_model_dir):
    template = ChatTemplate("{% if enable_thinking is defined and not enable_thinking %}<no_think>{% endif %}"
                            "{% for m in messages %}{{ m.content }}{% endfor %}{{ budget | default(0) + 1 }}")
    messages = [{"role": "user", "content": "hi"}]
    assert template.render(messages, enable_thinking=False, budget=41) == "<no_think>hi42"
    assert template.render(messages) == "hi1"


def test_qwen_tools_render_like_transformers():
    model_dir = shared_model_dir("tiny-qwen2.5-bpe")
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather <now> & 'later' in a city, e.g. Zürich",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    messages = [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
        {"role": "tool", "content": "{\"temp\": 21}"},
    ]
    tok = load_tokenizer(model_dir)
    text, ids = tok.apply_chat_template(messages, tools=tools)
    assert ids == _hf_ids(model_dir, messages, tools=tools)
    assert "Zürich" in text and "<now> & 'later'" in text  # tojson neither escapes HTML nor ASCII


def test_llama2_alternation_error_is_a_clear_value_error():
    tok = load_tokenizer(shared_model_dir("tiny-llama2-spm"))
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ValueError, match="Conversation roles must alternate user/assistant"):
        tok.apply_chat_template(messages)
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template(messages)


def test_raise_exception_from_any_template():
    template = ChatTemplate("{{ raise_exception('only user messages, please') }}")
    with pytest.raises(ChatTemplateError, match="only user messages, please"):
        template.render([{"role": "user", "content": "x"}])


def test_empty_conversation_rejected(demo_model_dir):
    with pytest.raises(ValueError, match="empty conversation"):
        load_tokenizer(demo_model_dir).apply_chat_template([])


def test_tojson_options_match_transformers():
    template = ChatTemplate("{{ x | tojson }}|{{ x | tojson(indent=2, sort_keys=True) }}|"
                            "{{ x | tojson(separators=(',', ':'), ensure_ascii=True) }}")
    x = {"b": "<é>", "a": [1, 2]}
    expected = "|".join([json.dumps(x, ensure_ascii=False), json.dumps(x, ensure_ascii=False, indent=2, sort_keys=True),
                         json.dumps(x, separators=(",", ":"), ensure_ascii=True)])
    assert template.render([{"role": "user", "content": ""}], x=x) == expected


def test_trim_blocks_loopcontrols_namespace_and_strftime():
    source = ("{% set ns = namespace(n=0) %}\n"
              "{% for m in messages %}\n"
              "    {% if m.role == 'skip' %}{% continue %}{% endif %}\n"
              "{% set ns.n = ns.n + 1 %}{{ m.content }};\n"
              "{% endfor %}\n"
              "{{ ns.n }} {{ strftime_now('%Y') | length }}")
    out = ChatTemplate(source).render([{"role": "user", "content": "a"}, {"role": "skip", "content": "b"},
                                       {"role": "user", "content": "c"}])
    assert out == "a;\nc;\n2 4"


def test_sandbox_refuses_python_internals():
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}").render(
            [{"role": "user", "content": "x"}])


# A retrieval template in the shape Command-R's and Granite's are written: documents listed before the turns.
RAG_TEMPLATE = ("{{ bos_token }}{% if documents %}{% for d in documents %}"
                "[{{ loop.index }}] {{ d.title }}: {{ d.text }}\n{% endfor %}{% endif %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
DOCUMENTS = [{"title": "Zürich", "text": "21 °C, sunny"}, {"title": "Oslo", "text": "4 °C, rain"}]


def test_a_requests_own_template_and_documents_render_as_transformers_renders_them(model_dir, tok):
    messages = CONVERSATIONS["system + user"]
    hf = load_hf_tokenizer(model_dir)
    for documents in (DOCUMENTS, None):
        text, ids = tok.apply_chat_template(messages, chat_template=RAG_TEMPLATE, documents=documents)
        assert text == hf.apply_chat_template(messages, chat_template=RAG_TEMPLATE, documents=documents,
                                              add_generation_prompt=True, tokenize=False)
        assert ids == _hf_ids(model_dir, messages, chat_template=RAG_TEMPLATE, documents=documents)
    assert "[2] Oslo: 4 °C, rain" in tok.apply_chat_template(messages, chat_template=RAG_TEMPLATE,
                                                             documents=DOCUMENTS)[0]
    # The model's own template is untouched by a request's.
    assert tok.apply_chat_template(messages)[1] == _hf_ids(model_dir, messages)


def test_add_special_tokens_adds_the_tokenizers_own_to_the_rendered_text(model_dir, tok):
    messages = CONVERSATIONS["single user"]
    text, plain = tok.apply_chat_template(messages)
    with_special = tok.apply_chat_template(messages, add_special_tokens=True)[1]
    assert with_special == tok.encode(text, add_special_tokens=True)
    assert with_special == load_hf_tokenizer(model_dir)(text, add_special_tokens=True)["input_ids"]
    assert len(with_special) >= len(plain)


def test_a_requests_template_that_does_not_compile_is_a_chat_template_error(demo_model_dir):
    with pytest.raises(ChatTemplateError, match="does not compile"):
        load_tokenizer(demo_model_dir).apply_chat_template([{"role": "user", "content": "x"}],
                                                           chat_template="{% for m in messages %}")
