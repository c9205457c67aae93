"""tool_choice "auto" through gateways started with `--tool-call-parser hermes` and `mistral`: the
calls the model writes in that syntax come back as `tool_calls`, whole and streamed. This random
model writes one only when its text is guided to it, which a `guided_regex` does here."""
from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from engine.demo_tokenizer import BOS_TOKEN
from services.common.settings import ConfigError
from services.gateway.config import GatewayConfig
from tests.services.gateway.mesh import gateway_client

TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
CALL = r'Checking\. <tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'
MESSAGES = [{"role": "user", "content": "What time is it?"}]


@pytest.fixture(scope="module")
def hermes(mesh):
    with gateway_client(mesh, "--tool-call-parser", "hermes") as client:
        yield client


def test_the_models_own_calls_come_back_as_tool_calls(mesh, hermes):
    kwargs = dict(model=mesh.model_name, messages=MESSAGES, max_tokens=300, temperature=0, tools=TOOLS,
                  extra_body={"guided_regex": CALL})
    whole = hermes.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Checking."
    [call] = whole.message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")

    # Streamed as vLLM streams them: the call's id and name once its name is whole, then its arguments
    # piece by piece, before the chunk that ends the reply.
    content, pieces, reason = "", [], None
    for chunk in hermes.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        pieces += [(piece, chunk.choices[0].finish_reason) for piece in delta.tool_calls or []]
        reason = chunk.choices[0].finish_reason or reason
    assert "<" not in content and content.strip() == "Checking." and reason == "tool_calls"
    (first, first_chunk_reason), *rest = pieces
    assert first.index == 0 and first.id.startswith("call_") and first.function.name == "get_time"
    assert first_chunk_reason is None and len(rest) > 1
    assert all(p.index == 0 and p.id is None and p.function.name is None for p, _ in rest)
    assert "".join(p.function.arguments or "" for p, _ in pieces) == call.function.arguments

    plain = hermes.chat.completions.create(model=mesh.model_name, messages=MESSAGES, max_tokens=5, temperature=0,
                                           tools=TOOLS, extra_body={"guided_regex": "[a-z ]+"}).choices[0]
    assert plain.message.content and not plain.message.tool_calls and plain.finish_reason in ("stop", "length")
    mesh.assert_decode_pools_free()


TWO_CALLS = (r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}</tool_call>'
             r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "CET"\}\}</tool_call>')


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_keeps_a_replys_first_call_only(mesh, hermes, stream):
    kwargs = dict(model=mesh.model_name, messages=MESSAGES, max_tokens=300, temperature=0, tools=TOOLS,
                  extra_body={"guided_regex": TWO_CALLS}, stream=stream)

    def calls(**more) -> list[tuple[str, str]]:
        out = hermes.chat.completions.create(**kwargs, **more)
        if not stream:
            assert out.choices[0].finish_reason == "tool_calls"
            return [(c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls]
        made: dict[int, list[str]] = {}
        for chunk in out:
            for piece in chunk.choices[0].delta.tool_calls or []:
                made.setdefault(piece.index, [piece.function.name, ""])[1] += piece.function.arguments or ""
        return [tuple(made[i]) for i in sorted(made)]

    both = calls()
    assert [json.loads(arguments)["zone"] for _, arguments in both] == ["UTC", "CET"]
    assert calls(parallel_tool_calls=False) == both[:1]
    mesh.assert_decode_pools_free()


def test_the_parser_is_named_by_flag_or_environment_and_checked(tiny_demo_model):
    common = ["--model", str(tiny_demo_model), "--tokenizer", "127.0.0.1:1", "--prefill", "127.0.0.1:2",
              "--decode", "127.0.0.1:3"]
    assert GatewayConfig.from_args(common, {}).tool_call_parser is None
    assert GatewayConfig.from_args(common, {"BATON_GATEWAY_TOOL_CALL_PARSER": "hermes"}).tool_call_parser == "hermes"
    step = GatewayConfig.from_args([*common, "--tool-call-parser", "step3p5", "--reasoning-parser", "step3p5"], {})
    assert (step.tool_call_parser, step.reasoning_parser) == ("qwen3_coder", "step3p5")  # (vLLM's names for Step's)
    with pytest.raises(ConfigError,
                       match="--tool-call-parser must be one of hermes, llama3_json, pythonic, mistral, qwen3_coder, "
                             "glm45, deepseek_v3, deepseek_v31, kimi_k2, granite, phi4_mini_json, openai, seed_oss, "
                             "minimax_m2, "
                             "got 'granite4'"):
        GatewayConfig.from_args([*common, "--tool-call-parser", "granite4"], {})
    with pytest.raises(ConfigError, match="--tool-call-parser"):
        GatewayConfig.from_args(common, {"BATON_GATEWAY_TOOL_CALL_PARSER": "granite4"})


def test_mistral_calls_come_back_with_ids_its_templates_take(mesh, hermes):
    """Mistral's [TOOL_CALLS] is a special token: its parser keeps special tokens in the text it reads,
    which leaves them in the content too, as vLLM's does."""
    call = r'Checking\.\[TOOL_CALLS\]get_time\[ARGS\]\{"zone": "(UTC|CET)"\}'
    kwargs = dict(model=mesh.model_name, messages=MESSAGES, max_tokens=300, temperature=0, tools=TOOLS,
                  extra_body={"guided_regex": call})
    with gateway_client(mesh, "--tool-call-parser", "mistral") as mistral:
        whole = mistral.chat.completions.create(**kwargs).choices[0]
        pieces = [piece for chunk in mistral.chat.completions.create(stream=True, **kwargs)
                  for piece in chunk.choices[0].delta.tool_calls or []]
        bos = Tokenizer.from_file(str(mesh.model_dir / "tokenizer.json")).token_to_id(BOS_TOKEN)
        special = dict(model=mesh.model_name, messages=MESSAGES, max_tokens=2, temperature=0, tools=TOOLS,
                       logit_bias={str(bos): 100})
        kept = mistral.chat.completions.create(**special).choices[0].message.content
        forced = mistral.chat.completions.create(
            model=mesh.model_name, messages=MESSAGES, max_tokens=60, temperature=0, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0].message.tool_calls
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Checking."
    [made] = whole.message.tool_calls
    assert made.function.name == "get_time" and json.loads(made.function.arguments)["zone"] in ("UTC", "CET")
    assert len(made.id) == 9 and made.id.isalnum()
    [forced_call] = forced  # a forced call's id is of the same kind: the next turn's template takes it
    assert len(forced_call.id) == 9 and forced_call.id.isalnum()
    assert pieces[0].function.name == "get_time" and len(pieces) > 2
    assert "".join(p.function.arguments or "" for p in pieces) == made.function.arguments
    assert kept == BOS_TOKEN * 2
    assert hermes.chat.completions.create(**special).choices[0].message.content == ""
    mesh.assert_decode_pools_free()


@pytest.mark.parametrize(("parser", "call"), [
    ("qwen3_coder", r"Checking\.\n<tool_call>\n<function=get_forecast>\n<parameter=days>\n[1-7]\n</parameter>\n"
                    r"<parameter=city>\n(Oslo|Bern)\n</parameter>\n</function>\n</tool_call>"),
    ("minimax_m2", r'Checking\.\n<minimax:tool_call>\n<invoke name="get_forecast">\n<parameter name="days">[1-7]'
                   r'</parameter>\n<parameter name="city">(Oslo|Bern)</parameter>\n</invoke>\n</minimax:tool_call>'),
    ("glm45", r"Checking\.\n<tool_call>get_forecast\n<arg_key>days</arg_key>\n<arg_value>[1-7]</arg_value>\n"
              r"<arg_key>city</arg_key>\n<arg_value>(Oslo|Bern)</arg_value>\n</tool_call>"),
])
def test_tagged_calls_come_back_typed_by_the_tools_schemas(mesh, parser, call):
    """Qwen3-Coder's, MiniMax-M2's and GLM-4.5's calls, an argument a tag each: its text becomes the type its tool
    declares (an integer here), a string stays text."""
    tools = [{"type": "function", "function": {"name": "get_forecast", "parameters": {
        "type": "object", "properties": {"days": {"type": "integer"}, "city": {"type": "string"}}}}}]
    kwargs = dict(model=mesh.model_name, messages=MESSAGES, max_tokens=300, temperature=0, tools=tools,
                  extra_body={"guided_regex": call})
    with gateway_client(mesh, "--tool-call-parser", parser) as qwen:
        whole = qwen.chat.completions.create(**kwargs).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content == "Checking."
        [made] = whole.message.tool_calls
        arguments = json.loads(made.function.arguments)
        assert made.function.name == "get_forecast" and isinstance(arguments["days"], int)
        assert arguments["city"] in ("Oslo", "Bern")
        pieces = [piece for chunk in qwen.chat.completions.create(stream=True, **kwargs)
                  for piece in chunk.choices[0].delta.tool_calls or []]
        assert pieces[0].function.name == "get_forecast"
        assert "".join(p.function.arguments or "" for p in pieces) == made.function.arguments
    mesh.assert_decode_pools_free()
