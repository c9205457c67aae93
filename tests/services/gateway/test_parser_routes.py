"""SGLang's parsers as endpoints (services/gateway/parser_routes.py), `/parse_function_call` and
`/separate_reasoning`, read as the chat API reads a reply; and the parsers named by SGLang's names
as well as vLLM's, in requests and in the gateway's flags."""
from __future__ import annotations

import json

import httpx
import pytest

from services.common.settings import ConfigError
from services.gateway.config import GatewayConfig

TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}, "hours": {"type": "integer"}}}}}]


def post(mesh, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{mesh.gateway.base_url}{path}", json=body, timeout=30)


@pytest.mark.parametrize("parser", ["qwen25", "hermes"])
def test_calls_come_apart_from_the_text_before_them(mesh, parser):
    text = ('Let me check. <tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    answer = post(mesh, "/parse_function_call", {"text": text, "tools": TOOLS, "tool_call_parser": parser})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"normal_text": "Let me check.", "calls": [
        {"tool_index": 0, "name": "get_time", "parameters": '{"zone": "UTC"}'},
        {"tool_index": 1, "name": "get_time", "parameters": '{"zone": "CET"}'}]}
    plain = post(mesh, "/parse_function_call", {"text": "No calls.", "tool_call_parser": parser}).json()
    assert plain == {"normal_text": "No calls.", "calls": []}


def test_typed_and_harmony_calls_are_read_as_chat_reads_them(mesh):
    xml = "<tool_call>\n<function=get_time>\n<parameter=hours>\n3\n</parameter>\n</function>\n</tool_call>"
    answer = post(mesh, "/parse_function_call", {"text": xml, "tools": TOOLS, "tool_call_parser": "qwen3_coder"})
    [call] = answer.json()["calls"]
    assert json.loads(call["parameters"]) == {"hours": 3}  # typed by the tool's schema
    harmony = ("<|channel|>analysis<|message|>Need the time.<|end|><|start|>assistant<|channel|>commentary "
               'to=functions.get_time <|constrain|>json<|message|>{"zone": "UTC"}')
    answer = post(mesh, "/parse_function_call", {"text": harmony, "tools": TOOLS, "tool_call_parser": "gpt-oss"})
    assert answer.json() == {"normal_text": "", "calls": [
        {"tool_index": 0, "name": "get_time", "parameters": '{"zone": "UTC"}'}]}


@pytest.mark.parametrize(("parser", "text", "reasoning", "answer"), [
    ("deepseek-r1", "Two and two.</think>\n\nFour.", "Two and two.", "\n\nFour."),
    ("deepseek_r1", "<think>Two and two.</think>Four.", "Two and two.", "Four."),
    ("qwen3-thinking", "Two and two.</think>Four.", "Two and two.", "Four."),
    ("qwen3", "Two and two.</think>Four.", "", "Two and two.</think>Four."),  # thinks only where it opens
    ("qwen3", "<think>Two and two.</think>Four.", "Two and two.", "Four."),
    ("deepseek-r1", "Cut short while thin", "Cut short while thin", ""),
    ("gpt-oss", "<|channel|>analysis<|message|>Two and two.<|end|><|start|>assistant<|channel|>final<|message|>Four.",
     "Two and two.", "Four."),
])
def test_thinking_comes_apart_from_the_answer(mesh, parser, text, reasoning, answer):
    response = post(mesh, "/separate_reasoning", {"text": text, "reasoning_parser": parser})
    assert response.status_code == 200, response.text
    assert response.json() == {"reasoning_text": reasoning, "text": answer}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/parse_function_call", {"text": "x"}, "tool_call_parser"),  # this gateway has no parser of its own
    ("/parse_function_call", {"text": "x", "tool_call_parser": "step3"}, "tool_call_parser"),
    ("/parse_function_call", {"text": "x", "tool_call_parser": "hermes", "tools": [{"type": "function"}]}, "tools"),
    ("/parse_function_call", {"tool_call_parser": "hermes"}, "text"),
    ("/separate_reasoning", {"text": "x"}, "reasoning_parser"),
    ("/separate_reasoning", {"text": "x", "reasoning_parser": "kimi"}, "reasoning_parser"),
])
def test_what_cannot_be_parsed_is_a_400_naming_the_field(mesh, path, body, param):
    response = post(mesh, path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_the_gateways_flags_take_sglangs_names(tiny_demo_model):
    common = ["--model", str(tiny_demo_model), "--tokenizer", "127.0.0.1:1", "--prefill", "127.0.0.1:2",
              "--decode", "127.0.0.1:3"]
    config = GatewayConfig.from_args([*common, "--tool-call-parser", "qwen25", "--reasoning-parser", "deepseek-r1"], {})
    assert (config.tool_call_parser, config.reasoning_parser) == ("hermes", "deepseek_r1")
    config = GatewayConfig.from_args(common, {"BATON_GATEWAY_TOOL_CALL_PARSER": "gpt-oss"})
    assert (config.tool_call_parser, config.reasoning_parser) == ("openai", "openai_gptoss")
    assert GatewayConfig.from_args([*common, "--tool-call-parser", "llama3"], {}).tool_call_parser == "llama3_json"
    with pytest.raises(ConfigError, match="--reasoning-parser must be one of"):
        GatewayConfig.from_args([*common, "--reasoning-parser", "kimi"], {})
