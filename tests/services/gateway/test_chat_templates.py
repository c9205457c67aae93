"""vLLM's chat-template extras through the gateway: a request's own template (only where the gateway
trusts them), documents for retrieval templates, and `add_special_tokens`, each giving the model the
ids `transformers` renders, on the HTTP chat API, `/tokenize` and the gRPC API alike."""
from __future__ import annotations

import grpc
import httpx
import openai
import pytest

from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.common.settings import ConfigError
from services.gateway.config import GatewayConfig
from services.gateway.responses_request import ResponsesRequest
from tests.services.gateway.mesh import gateway_client

MESSAGES = [{"role": "system", "content": "Answer from the documents."},
            {"role": "user", "content": "How warm is it in Zürich?"}]
DOCUMENTS = [{"title": "Zürich", "text": "21 °C and sunny"}, {"title": "Oslo", "text": "4 °C, rain"}]
RAG_TEMPLATE = ("{{ bos_token }}{% for d in documents or [] %}<doc id={{ loop.index }} title={{ d.title | tojson }}>"
                "{{ d.text }}</doc>\n{% endfor %}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def hf_tokenizer(mesh):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(mesh.model_dir))


def transformers_ids(hf_tokenizer, messages=MESSAGES, **kwargs) -> list[int]:
    out = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def base_url(client: openai.OpenAI) -> str:
    return str(client.base_url).removesuffix("/").removesuffix("/v1")


def test_a_requests_own_template_is_refused_unless_the_gateway_trusts_them(mesh, client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=mesh.model_name, messages=MESSAGES, max_tokens=1,
                                       extra_body={"chat_template": RAG_TEMPLATE})
    error = refused.value.body
    assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"]
    response = httpx.post(f"{mesh.gateway.base_url}/tokenize", timeout=30,
                          json={"messages": MESSAGES, "chat_template": RAG_TEMPLATE})
    assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template"
    # Nor in through the variables: transformers would take that one as the template.
    with pytest.raises(openai.BadRequestError, match="cannot set chat_template"):
        client.chat.completions.create(model=mesh.model_name, messages=MESSAGES, max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"chat_template": RAG_TEMPLATE}})
    with grpc.insecure_channel(mesh.gateway.grpc_address) as channel:
        [reply] = gateway_pb2_grpc.GenerateStub(channel).Generate(gateway_pb2.GenerateRequest(
            chat=common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(**m) for m in MESSAGES]),
            sampling=common_pb2.SamplingParams(max_tokens=1),
            chat_options=gateway_pb2.ChatOptions(chat_template=RAG_TEMPLATE)), timeout=30)
    assert reply.error.code == 400 and reply.error.param == "chat_template"
    mesh.assert_decode_pools_free()


def test_a_trusted_requests_template_and_documents_are_what_the_model_is_given(mesh, hf_tokenizer):
    expected = transformers_ids(hf_tokenizer, chat_template=RAG_TEMPLATE, documents=DOCUMENTS)
    assert "Zürich" in hf_tokenizer.decode(expected) and len(expected) > len(transformers_ids(hf_tokenizer))
    with gateway_client(mesh, "--trust-request-chat-template") as trusted:
        extras = {"chat_template": RAG_TEMPLATE, "documents": DOCUMENTS, "ignore_eos": True}
        chat = trusted.chat.completions.create(model=mesh.model_name, messages=MESSAGES, max_tokens=8,
                                               temperature=0, extra_body=extras)
        assert chat.usage.prompt_tokens == len(expected)
        # The very ids: the same greedy text as a completion of them.
        by_ids = trusted.completions.create(model=mesh.model_name, prompt=expected, max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True})
        assert chat.choices[0].message.content == by_ids.choices[0].text
        tokenized = httpx.post(f"{base_url(trusted)}/tokenize", timeout=30, json={
            "messages": MESSAGES, "chat_template": RAG_TEMPLATE, "documents": DOCUMENTS}).json()
        assert tokenized["tokens"] == expected
        with pytest.raises(openai.BadRequestError) as broken:
            trusted.chat.completions.create(model=mesh.model_name, messages=MESSAGES, max_tokens=1,
                                            extra_body={"chat_template": "{% for m in messages %}"})
        assert "does not compile" in broken.value.body["message"]
    mesh.assert_decode_pools_free()

EFFORT_TEMPLATE = ("Reasoning: {{ reasoning_effort | default('medium') }}\n"
                   "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>")


def test_reasoning_effort_is_given_to_the_template(mesh, hf_tokenizer):
    """OpenAI's `reasoning_effort`, as vLLM gives it to templates (gpt-oss's writes it into its system
    message); a Responses request's `reasoning.effort` is the same."""
    expected = transformers_ids(hf_tokenizer, chat_template=EFFORT_TEMPLATE, reasoning_effort="high")
    assert "Reasoning: high" in hf_tokenizer.decode(expected)
    with gateway_client(mesh, "--trust-request-chat-template") as trusted:
        chat = trusted.chat.completions.create(model=mesh.model_name, messages=MESSAGES, max_tokens=8, temperature=0,
                                               reasoning_effort="high",
                                               extra_body={"chat_template": EFFORT_TEMPLATE, "ignore_eos": True})
        by_ids = trusted.completions.create(model=mesh.model_name, prompt=expected, max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True})
        with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
            trusted.chat.completions.create(model=mesh.model_name, messages=MESSAGES, max_tokens=1,
                                            extra_body={"reasoning_effort": "max"})
    assert chat.usage.prompt_tokens == len(expected) and chat.choices[0].message.content == by_ids.choices[0].text
    asked = ResponsesRequest(model=mesh.model_name, input="Hi", reasoning={"effort": "low"})
    assert asked.as_chat().chat_options().template_kwargs == {"reasoning_effort": "low"}
    mesh.assert_decode_pools_free()


GREETING_TEMPLATE = ("Greeting: {{ greeting | default('none') }}\n"
                     "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>")
AHOY = "Ahoy there, sailor of the seven seas"


def test_the_gateways_default_template_variables_go_under_the_requests_own(mesh, hf_tokenizer, tiny_demo_model):
    """vLLM's --default-chat-template-kwargs: what a request's chat_template_kwargs leaves out, for chat
    and /tokenize alike; the request's own win."""
    by_default = transformers_ids(hf_tokenizer, chat_template=GREETING_TEMPLATE, greeting=AHOY)
    own = transformers_ids(hf_tokenizer, chat_template=GREETING_TEMPLATE, greeting="Good morning to you all")
    assert len({len(by_default), len(own), len(transformers_ids(hf_tokenizer, chat_template=GREETING_TEMPLATE))}) == 3
    with gateway_client(mesh, "--trust-request-chat-template",
                        "--default-chat-template-kwargs", f'{{"greeting": "{AHOY}"}}') as trusted:
        url = base_url(trusted)
        chat = trusted.chat.completions.create(model=mesh.model_name, messages=MESSAGES, max_tokens=1,
                                               extra_body={"chat_template": GREETING_TEMPLATE})
        assert chat.usage.prompt_tokens == len(by_default)
        chat = trusted.chat.completions.create(model=mesh.model_name, messages=MESSAGES, max_tokens=1, extra_body={
            "chat_template": GREETING_TEMPLATE, "chat_template_kwargs": {"greeting": "Good morning to you all"}})
        assert chat.usage.prompt_tokens == len(own)
        tokens = httpx.post(f"{url}/tokenize", timeout=30,
                            json={"messages": MESSAGES, "chat_template": GREETING_TEMPLATE})
        assert tokens.json()["tokens"] == by_default
    common = ["--model", str(tiny_demo_model), "--tokenizer", "127.0.0.1:1", "--prefill", "127.0.0.1:2",
              "--decode", "127.0.0.1:3"]
    assert GatewayConfig.from_args(common, {"BATON_DEFAULT_CHAT_TEMPLATE_KWARGS": '{"enable_thinking": false}'}
                                   ).default_chat_template_kwargs == {"enable_thinking": False}
    for bad, said in (("[1]", "a JSON object"), ("{", "not JSON"), ('{"messages": []}', "cannot set messages")):
        with pytest.raises(ConfigError, match=said):
            GatewayConfig.from_args([*common, "--default-chat-template-kwargs", bad], {})


def test_add_special_tokens_puts_the_tokenizers_own_before_the_templates_text(mesh, client, hf_tokenizer):
    text = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    plain = client.chat.completions.create(model=mesh.model_name, messages=MESSAGES, max_tokens=1)
    added = client.chat.completions.create(model=mesh.model_name, messages=MESSAGES, max_tokens=1,
                                           extra_body={"add_special_tokens": True})
    assert plain.usage.prompt_tokens == len(hf_tokenizer(text, add_special_tokens=False)["input_ids"])
    assert added.usage.prompt_tokens == len(hf_tokenizer(text, add_special_tokens=True)["input_ids"])
    assert added.usage.prompt_tokens > plain.usage.prompt_tokens
    with grpc.insecure_channel(mesh.gateway.grpc_address) as channel:
        stub = gateway_pb2_grpc.GenerateStub(channel)
        chat = common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(**m) for m in MESSAGES])
        [reply] = stub.Generate(gateway_pb2.GenerateRequest(
            chat=chat, sampling=common_pb2.SamplingParams(max_tokens=1),
            chat_options=gateway_pb2.ChatOptions(add_special_tokens=True)), timeout=30)
        assert reply.complete.usage.prompt_tokens == added.usage.prompt_tokens
        [refused] = stub.Generate(gateway_pb2.GenerateRequest(
            chat=chat, sampling=common_pb2.SamplingParams(max_tokens=1),
            chat_options=gateway_pb2.ChatOptions(documents_json='{"title": "not a list"}')), timeout=30)
        assert refused.error.code == 400 and refused.error.param == "chat_options.documents_json"


# Gemma 3's way with a message's content: each text part trimmed, the parts one after another.
PARTS_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}{{ m['content'] | trim }}"
                  "{% else %}{% for part in m['content'] %}{{ part['text'] | trim }}{% endfor %}{% endif %}\n"
                  "{% endfor %}<|assistant|>")
PARTS = [{"type": "text", "text": " How warm is it "}, {"type": "text", "text": "in Zürich? "}]


def test_text_parts_reach_a_template_that_loops_over_them_as_parts(mesh, hf_tokenizer):
    """vLLM's --chat-template-content-format: auto gives a template that loops over a message's content
    its parts (as transformers gives a list), any other the parts joined by newlines; the flag forces one."""
    messages = [MESSAGES[0], {"role": "user", "content": PARTS}]
    joined = [MESSAGES[0], {"role": "user", "content": "\n".join(p["text"] for p in PARTS)}]
    as_parts = transformers_ids(hf_tokenizer, chat_template=PARTS_TEMPLATE, messages=messages)
    as_text = transformers_ids(hf_tokenizer, chat_template=PARTS_TEMPLATE, messages=joined)
    assert "Zürich" in hf_tokenizer.decode(as_parts) and as_parts != as_text
    for extra, expected in (((), as_parts), (("--chat-template-content-format", "string"), as_text)):
        with gateway_client(mesh, "--trust-request-chat-template", *extra) as trusted:
            chat = trusted.chat.completions.create(model=mesh.model_name, messages=messages, max_tokens=1,
                                                   extra_body={"chat_template": PARTS_TEMPLATE})
            assert chat.usage.prompt_tokens == len(expected)
            tokenized = httpx.post(f"{base_url(trusted)}/tokenize", timeout=30,
                                   json={"messages": messages, "chat_template": PARTS_TEMPLATE}).json()
            assert tokenized["tokens"] == expected
    # The model's own template reads text: parts sent by the gRPC API are joined for it.
    with grpc.insecure_channel(mesh.gateway.grpc_address) as channel:
        *_, reply = gateway_pb2_grpc.GenerateStub(channel).Generate(gateway_pb2.GenerateRequest(
            chat=common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(**MESSAGES[0]), common_pb2.ChatMessage(
                role="user", content_parts=[p["text"] for p in PARTS])]),
            sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=30)
    assert reply.complete.usage.prompt_tokens == len(transformers_ids(hf_tokenizer, messages=joined))
    mesh.assert_decode_pools_free()
