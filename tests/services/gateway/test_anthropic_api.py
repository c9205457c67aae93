"""Anthropic's Messages API through the mesh, by the `anthropic` client: the same output as chat for
the same conversation, whole and streamed as typed events, with stop sequences, token counts, tool
use (forced, and the model's own through a `--tool-call-parser` gateway) and the turn that answers
it; errors in Anthropic's shape. The request's translation is also checked alone."""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from services.gateway.anthropic_api import MessagesShape, _StreamedBlocks
from services.gateway.anthropic_request import MessagesRequest
from services.gateway.errors import APIError
from services.gateway.openai_responses import ResponseBuilder
from tests.services.gateway.mesh import gateway_client

GREEDY = {"temperature": 0}  # (the SDK takes sampling parameters as extras)
QUESTION = [{"role": "user", "content": "Name three colours."}]
TIME_TOOL = {"name": "get_time", "description": "The time in a zone.", "input_schema": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}
CALL = r'Checking\. <tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'


@pytest.fixture(scope="module")
def claude(mesh):
    with anthropic.Anthropic(base_url=mesh.gateway.base_url, api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def hermes(mesh):
    """A gateway that reads the model's own calls in Hermes' syntax."""
    with gateway_client(mesh, "--tool-call-parser", "hermes") as openai_client:
        base_url = str(openai_client.base_url).removesuffix("/").removesuffix("/v1")
        with anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0) as client:
            yield client


def chat(client, mesh, messages, **kwargs):
    return client.chat.completions.create(model=mesh.model_name, messages=messages, temperature=0, **kwargs)


def test_a_message_is_what_chat_answers_whole_and_streamed(mesh, client, claude):
    message = claude.messages.create(model=mesh.model_name, max_tokens=8, system="Be brief.", messages=QUESTION,
                                     extra_body=GREEDY)
    expected = chat(client, mesh, [{"role": "system", "content": "Be brief."}, *QUESTION], max_tokens=8)
    [block] = message.content
    assert block.type == "text" and block.text == expected.choices[0].message.content
    assert message.id.startswith("msg_") and message.role == "assistant" and message.model == mesh.model_name
    assert (message.stop_reason, message.stop_sequence) == ("max_tokens", None)
    assert message.usage.output_tokens == 8
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == expected.usage.prompt_tokens

    with claude.messages.stream(model=mesh.model_name, max_tokens=8, system="Be brief.", messages=QUESTION,
                                extra_body=GREEDY) as stream:
        events = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert streamed.content[0].text == block.text and streamed.stop_reason == "max_tokens"
    assert streamed.usage.output_tokens == 8
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert events.count("content_block_start") == events.count("content_block_stop") == 1
    raw = httpx.post(f"{mesh.gateway.base_url}/v1/messages", timeout=30, json={
        "model": mesh.model_name, "max_tokens": 2, "messages": QUESTION, "stream": True, "ignore_eos": True,
        **GREEDY}).text  # (sampled, its first token could be EOS, and the reply have no text block)
    assert [line for line in raw.splitlines() if line.startswith("event: ")][:3] == [
        "event: message_start", "event: ping", "event: content_block_start"]  # (the SDK passes pings over)
    mesh.assert_decode_pools_free()


def test_a_stop_sequence_ends_the_text_and_is_named(mesh, claude):
    text = claude.messages.create(model=mesh.model_name, max_tokens=12, messages=QUESTION,
                                  extra_body=GREEDY).content[0].text
    stop = text[4:7]
    message = claude.messages.create(model=mesh.model_name, max_tokens=12, messages=QUESTION, stop_sequences=[stop],
                                     extra_body=GREEDY)
    assert message.content[0].text == text[:text.index(stop)]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)


def test_count_tokens_is_the_prompts_count(mesh, claude):
    counted = claude.messages.count_tokens(model=mesh.model_name, system="Be brief.", messages=QUESTION)
    tokenized = httpx.post(f"{mesh.gateway.base_url}/tokenize", timeout=30, json={
        "messages": [{"role": "system", "content": "Be brief."}, *QUESTION]}).json()
    assert counted.input_tokens == tokenized["count"] > 0


def test_a_forced_tool_use_and_the_turn_that_answers_it(mesh, claude):
    message = claude.messages.create(model=mesh.model_name, max_tokens=60, messages=QUESTION, tools=[TIME_TOOL],
                                     tool_choice={"type": "tool", "name": "get_time"}, extra_body=GREEDY)
    [use] = message.content
    assert use.type == "tool_use" and use.name == "get_time" and use.input["zone"] in ("UTC", "CET")
    assert message.stop_reason == "tool_use"
    answered = claude.messages.create(model=mesh.model_name, max_tokens=4, tools=[TIME_TOOL], extra_body=GREEDY,
                                      tool_choice={"type": "none"}, messages=[
                                          *QUESTION, {"role": "assistant", "content": message.content},
                                          {"role": "user", "content": [
                                              {"type": "tool_result", "tool_use_id": use.id, "content": "12:00"}]}])
    assert answered.content[0].type == "text" and answered.stop_reason == "max_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_the_models_own_calls_come_back_as_tool_use_blocks(mesh, hermes, stream):
    kwargs = dict(model=mesh.model_name, max_tokens=300, messages=[{"role": "user", "content": "What time is it?"}],
                  tools=[TIME_TOOL], extra_body={**GREEDY, "guided_regex": CALL})
    if stream:
        with hermes.messages.stream(**kwargs) as events:
            kinds = [event.type for event in events]
            message = events.get_final_message()
        assert kinds.count("content_block_start") == 2 and "input_json" in kinds
    else:
        message = hermes.messages.create(**kwargs)
    text, use = message.content
    assert text.type == "text" and text.text.strip() == "Checking."
    assert use.type == "tool_use" and use.id and use.name == "get_time" and use.input["zone"] in ("UTC", "CET")
    assert message.stop_reason == "tool_use"
    mesh.assert_decode_pools_free()


@pytest.mark.parametrize(("kwargs", "status", "error_type"), [
    ({"model": "no-such-model"}, 404, "not_found_error"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]},
     400, "invalid_request_error"),
    ({"max_tokens": 5000}, 400, "invalid_request_error"),  # past the context
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": 5}]}]},
     400, "invalid_request_error"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_errors_come_in_anthropics_shape(mesh, claude, kwargs, status, error_type, stream):
    asked = {"model": mesh.model_name, "max_tokens": 4, "messages": QUESTION, **kwargs}
    with pytest.raises(anthropic.APIStatusError) as refused:
        if stream:
            with claude.messages.stream(**asked) as events:
                list(events)
        else:
            claude.messages.create(**asked)
    assert refused.value.status_code == status
    assert refused.value.body["type"] == "error" and refused.value.body["error"]["type"] == error_type
    mesh.assert_decode_pools_free()


def test_the_key_and_size_refusals_come_in_anthropics_shape_too(mesh):
    """Refused before the app's handlers (by the key's and the body limit's middleware), by the SDK."""
    with gateway_client(mesh, "--api-key", "sk-right", "--max-body-bytes", "2000") as keyed:
        base_url = str(keyed.base_url).removesuffix("/").removesuffix("/v1")
        for key, messages, status, error_type in (("sk-wrong", QUESTION, 401, "authentication_error"),
                                                  ("sk-right", [{"role": "user", "content": "x" * 3000}], 413,
                                                   "request_too_large")):
            with anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0) as client:
                with pytest.raises(anthropic.APIStatusError) as refused:
                    client.messages.create(model=mesh.model_name, max_tokens=4, messages=messages)
            assert refused.value.status_code == status
            assert refused.value.body["type"] == "error" and refused.value.body["error"]["type"] == error_type
        openai_shaped = httpx.post(f"{base_url}/v1/completions", headers={"Authorization": "Bearer sk-wrong"},
                                   json={"model": mesh.model_name, "prompt": "hi"}, timeout=10)
        assert openai_shaped.status_code == 401 and openai_shaped.json()["error"]["code"] == "invalid_api_key"


def test_max_tokens_is_required_for_a_message_but_not_for_a_count(mesh):
    body = {"model": mesh.model_name, "messages": QUESTION}
    missing = httpx.post(f"{mesh.gateway.base_url}/v1/messages", json=body, timeout=30)
    assert missing.status_code == 400 and "max_tokens" in missing.json()["error"]["message"]
    assert httpx.post(f"{mesh.gateway.base_url}/v1/messages/count_tokens", json=body, timeout=30).status_code == 200
    wrong_method = httpx.get(f"{mesh.gateway.base_url}/v1/messages", timeout=30)
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["type"] == "invalid_request_error"
    bad_json = httpx.post(f"{mesh.gateway.base_url}/v1/messages/count_tokens", content=b"{", timeout=30)
    assert bad_json.status_code == 400 and bad_json.json()["type"] == "error"


def test_the_request_as_chat():
    request = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}],
        "stop_sequences": ["\n"], "top_k": 5, "tools": [TIME_TOOL],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "Time?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "They want the time.", "signature": "s"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "UTC"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "12:00"}]},
                {"type": "text", "text": "And in CET?"}]}]})
    chat = request.as_chat()
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[0].content == "Be\nbrief."
    assistant = chat.messages[2]
    assert assistant.content == "Checking." and assistant.reasoning_content == "They want the time."
    assert assistant.tool_calls == [{"id": "toolu_1", "type": "function", "function": {
        "name": "get_time", "arguments": json.dumps({"zone": "UTC"})}}]
    assert (chat.messages[3].tool_call_id, chat.messages[3].content) == ("toolu_1", "12:00")
    assert chat.messages[4].content == "And in CET?"
    assert (chat.max_tokens, chat.stop, chat.top_k) == (9, ["\n"], 5)
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools[0]["function"]["parameters"] == TIME_TOOL["input_schema"]
    with pytest.raises(APIError) as refused:
        MessagesRequest.model_validate({"model": "m", "messages": [{"role": "system", "content": "x"}]}).as_chat()
    assert refused.value.param == "messages[0].role"


def test_thinking_switches_the_templates_thinking_under_the_requests_own_variables():
    def template_kwargs(**fields):
        return MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": QUESTION,
                                               **fields}).as_chat().chat_template_kwargs

    assert template_kwargs() is None
    assert template_kwargs(thinking={"type": "enabled", "budget_tokens": 2048}) == {
        "enable_thinking": True, "thinking": True}
    assert template_kwargs(thinking={"type": "adaptive"})["enable_thinking"] is True
    assert template_kwargs(thinking={"type": "disabled"}, chat_template_kwargs={"thinking": True, "x": 1}) == {
        "enable_thinking": False, "thinking": True, "x": 1}
    for bad in ({"type": "on"}, {}):
        with pytest.raises(APIError) as refused:
            template_kwargs(thinking=bad)
        assert refused.value.param == "thinking.type"
    with pytest.raises(APIError) as refused:
        template_kwargs(thinking={"type": "enabled"}, chat_template_kwargs=[1])
    assert refused.value.param == "chat_template_kwargs"


def test_thinking_and_the_effort_reach_the_template_and_the_token_count(mesh):
    """A template that shows both: the message's prompt and count_tokens' count grow with them alike."""
    template = ("{% if enable_thinking %}<think on>{% endif %}{{ reasoning_effort | default('') }}"
                "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>")
    with gateway_client(mesh, "--trust-request-chat-template") as trusted:
        base_url = str(trusted.base_url).removesuffix("/").removesuffix("/v1")
        with anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0) as client:
            def counts(**extra):
                body = {"chat_template": template, **extra}
                sent = client.messages.create(model=mesh.model_name, max_tokens=1, messages=QUESTION, extra_body=body)
                counted = client.messages.count_tokens(model=mesh.model_name, messages=QUESTION, extra_body=body)
                assert counted.input_tokens == sent.usage.input_tokens + (sent.usage.cache_read_input_tokens or 0)
                return counted.input_tokens

            plain = counts()
            assert counts(thinking={"type": "enabled", "budget_tokens": 1024}) > plain
            assert counts(thinking={"type": "disabled"}) == plain
            assert counts(reasoning_effort="high") > plain


def test_chats_sampling_extras_pass_and_other_fields_ask_nothing():
    chat = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 4, "messages": QUESTION, "seed": 7, "min_p": 0.1, "guided_regex": "[a-z]+",
        "metadata": {"user_id": "u"}, "service_tier": "auto", "n": 3, "logprobs": True}).as_chat()
    assert (chat.seed, chat.min_p, chat.guided_regex) == (7, 0.1, "[a-z]+")
    assert chat.n == 1 and not chat.logprobs  # what would change the answer's shape is not chat's to take
    with pytest.raises(APIError) as refused:
        MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": QUESTION, "min_p": 2}).as_chat()
    assert refused.value.param == "min_p"


def test_thinking_comes_first_as_its_own_block():
    """The translation alone, from chat output with thinking in it, as a reasoning parser gives it."""
    builder = ResponseBuilder(kind="chat", response_id="msg_x", model="m", num_choices=1, prompt_of_choice=[0],
                              token_text=str, want_logprobs=False)
    usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15, "prompt_tokens_details": {
        "cached_tokens": 4}}
    chat = {"choices": [{"index": 0, "finish_reason": "stop", "stop_reason": None, "message": {
        "role": "assistant", "content": "Blue.", "reasoning": "Pick one.", "tool_calls": []}}], "usage": usage}
    body = MessagesShape(builder).whole(chat)
    signature = body["content"][0].pop("signature")
    assert len(signature) == 32 and MessagesShape(builder).whole(chat)["content"][0]["signature"] != signature
    assert body["content"] == [{"type": "thinking", "thinking": "Pick one."}, {"type": "text", "text": "Blue."}]
    assert body["stop_reason"] == "end_turn" and body["usage"] == {
        "input_tokens": 6, "output_tokens": 5, "cache_read_input_tokens": 4, "cache_creation_input_tokens": 0}

    blocks = _StreamedBlocks()
    chunks = [{"delta": {"role": "assistant", "reasoning": "Pick"}, "finish_reason": None},
              {"delta": {"reasoning": " one.", "content": "Blue"}, "finish_reason": None},
              {"delta": {"content": "."}, "finish_reason": "stop"}]
    events = [json.loads(raw.split(b"data: ", 1)[1]) for chunk in chunks
              for raw in blocks.chunk({"choices": [{"index": 0, **chunk}]})]
    assert [(e["type"], e.get("index")) for e in events] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_delta", 1), ("content_block_stop", 1)]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert deltas[2]["type"] == "signature_delta" and len(deltas.pop(2)["signature"]) == 32
    assert deltas == [
        {"type": "thinking_delta", "thinking": "Pick"}, {"type": "thinking_delta", "thinking": " one."},
        {"type": "text_delta", "text": "Blue"}, {"type": "text_delta", "text": "."}]
