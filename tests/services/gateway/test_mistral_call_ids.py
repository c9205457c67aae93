"""A conversation with OpenAI-style tool-call ids ("call_..."), as agent frameworks send them, to a
model whose chat template takes only Mistral's (9 letters and digits): with `--tool-call-parser
mistral` the gateway gives the template ids it takes, the same for a call and the tool message
answering it, by the chat API and the Responses API alike; without it, the template's refusal is a
400. The template here is a small one of our own that checks ids as Mistral's do."""
from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest

from services.gateway.tool_parsers import PARSERS, with_template_call_ids
from tests.services.gateway.mesh import gateway_client, start_mesh, stop_mesh

STRICT_IDS_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- if call['id'] | length != 9 or not call['id'].isalnum() %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{%- endif %}"
    "{{- '[TOOL_CALLS]' + call['function']['name'] + '[CALL_ID]' + call['id'] + '[ARGS]' }}"
    "{{- call['function']['arguments'] | tojson }}"
    "{%- endfor %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if message['tool_call_id'] | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{%- endif %}"
    "{{- '[TOOL_RESULTS]' + message['tool_call_id'] + message['content'] + '[/TOOL_RESULTS]' }}"
    "{%- elif message['content'] %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CALL_ID = "call_7f3c2a9be1d04c5f8a6b"
CONVERSATION = [
    {"role": "user", "content": "What time is it?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": CALL_ID, "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
    {"role": "tool", "tool_call_id": CALL_ID, "content": "12:00"},
]


@pytest.fixture(scope="module")
def strict_mesh(tiny_demo_model, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("strict") / tiny_demo_model.name
    shutil.copytree(tiny_demo_model, model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": STRICT_IDS_TEMPLATE}))
    mesh = start_mesh(model_dir, num_prefill=1, num_decode=1, gateway_args=("--tool-call-parser", "mistral"))
    try:
        yield mesh
    finally:
        assert all(code == 0 for code in stop_mesh(mesh).values())


def test_openai_style_ids_reach_a_mistral_template_as_ids_it_takes(strict_mesh):
    client = openai.OpenAI(base_url=f"{strict_mesh.gateway.base_url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=strict_mesh.model_name, messages=CONVERSATION, max_tokens=3,
                                           extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 3
    response = client.responses.create(model=strict_mesh.model_name, max_output_tokens=3, temperature=0, input=[
        {"role": "user", "content": "What time is it?"},
        {"type": "function_call", "call_id": CALL_ID, "name": "get_time", "arguments": '{"zone": "UTC"}'},
        {"type": "function_call_output", "call_id": CALL_ID, "output": "12:00"}])
    assert response.status in ("completed", "incomplete") and response.usage.input_tokens > 0
    # /tokenize counts what generation is given: the same shortened ids.
    counted = httpx.post(f"{strict_mesh.gateway.base_url}/tokenize", timeout=30,
                         json={"messages": CONVERSATION, "add_generation_prompt": True}).json()
    assert counted["count"] == reply.usage.prompt_tokens

    # A gateway reading another syntax passes the ids as given: the template refuses them, a 400.
    with gateway_client(strict_mesh, "--tool-call-parser", "hermes") as other:
        with pytest.raises(openai.BadRequestError, match="alphanumeric strings with length 9"):
            other.chat.completions.create(model=strict_mesh.model_name, messages=CONVERSATION, max_tokens=3)
    strict_mesh.assert_decode_pools_free()


def test_a_call_and_its_answer_get_the_same_id():
    messages = with_template_call_ids(json.loads(json.dumps(CONVERSATION)), "mistral")
    made = messages[1]["tool_calls"][0]["id"]
    assert len(made) == 9 and made.isalnum() and messages[2]["tool_call_id"] == made
    assert PARSERS["mistral"].template_call_id("a1B2c3D4e") == "a1B2c3D4e"  # one it takes stays
    assert PARSERS["mistral"].template_call_id("call_other") != made
    assert with_template_call_ids(json.loads(json.dumps(CONVERSATION)), "hermes") == CONVERSATION

    assert with_template_call_ids(json.loads(json.dumps(CONVERSATION)), None) == CONVERSATION
