"""vLLM's serving flags for the HTTP server and the chat API: the access log (on by default, as
vLLM's and SGLang's; --disable-uvicorn-access-log), --root-path behind a proxy that strips it,
--response-role, --exclude-tools-when-tool-choice-none, and --enable-tokenizer-info-endpoint's
GET /tokenizer_info, checked against what transformers loads from the same tokenizer, and
--enable-per-request-metrics' `metrics` in replies, checked against their ledgers."""
from __future__ import annotations

import json
import time

import grpc
import httpx
import openai
import pytest

from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.common.settings import ConfigError
from services.gateway.config import GatewayConfig
from tests.services.gateway.mesh import GatewayProcess

KEY = "sk-flags"
# Shows the tools it is given, so that their being in the prompt shows in its length.
TOOLS_TEMPLATE = ("{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
                  "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>")
ZONE = {"type": "object", "properties": {"zone": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": ZONE}}]
MESSAGES = [{"role": "user", "content": "What time is it?"}]


@pytest.fixture(scope="module")
def flagged(mesh):
    gateway = GatewayProcess(mesh.model_dir, mesh.tokenizer.address, [p.address for p in mesh.prefill],
                             [d.address for d in mesh.decode], "--api-key", KEY, "--root-path", "/llm",
                             "--disable-uvicorn-access-log", "--response-role", "model",
                             "--exclude-tools-when-tool-choice-none", "--trust-request-chat-template",
                             "--enable-tokenizer-info-endpoint", "--return-tokens-as-token-ids",
                             "--enable-per-request-metrics")
    try:
        yield gateway
    finally:
        assert gateway.terminate() == 0


@pytest.fixture
def flagged_client(flagged):
    with openai.OpenAI(base_url=f"{flagged.base_url}/v1", api_key=KEY, max_retries=0) as client:
        yield client


def access_lines(gateway: GatewayProcess, path: str) -> list[str]:
    return [line for line in list(gateway.stderr_lines) if "uvicorn.access" in line and f" {path} HTTP/1.1" in line]


def test_each_http_request_is_in_the_access_log_unless_it_is_disabled(mesh, client, flagged, flagged_client):
    client.completions.create(model=mesh.model_name, prompt="Once upon a time", max_tokens=2)
    flagged_client.completions.create(model=mesh.model_name, prompt="Once upon a time", max_tokens=2)
    assert httpx.get(f"{mesh.gateway.base_url}/v1/models?probe=access", timeout=10).status_code == 200
    deadline = time.monotonic() + 10
    while not (access_lines(mesh.gateway, "/v1/completions") and access_lines(mesh.gateway, "/v1/models?probe=access")):
        assert time.monotonic() < deadline, mesh.gateway.stderr_lines[-5:]
        time.sleep(0.02)
    assert '"POST /v1/completions HTTP/1.1" 200' in access_lines(mesh.gateway, "/v1/completions")[-1]
    assert not [line for line in flagged.stderr_lines if "uvicorn.access" in line]


def test_behind_a_proxy_that_strips_the_root_path_the_api_and_its_open_paths_are_served(mesh, flagged,
                                                                                         flagged_client):
    """The proxy forwards /llm/v1/... as /v1/...: routes, the API key's open paths (a probe carries
    no key) and the Messages API's error shape are matched without the prefix."""
    assert [m.id for m in flagged_client.models.list()] == [mesh.model_name]
    assert httpx.get(f"{flagged.base_url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{flagged.base_url}/metrics", timeout=10).status_code == 200
    assert httpx.get(f"{flagged.base_url}/v1/models", timeout=10).status_code == 401
    refused = httpx.post(f"{flagged.base_url}/v1/messages", headers={"x-api-key": KEY}, timeout=10,
                         json={"model": mesh.model_name, "messages": MESSAGES})
    assert refused.status_code == 400 and refused.json()["type"] == "error"  # Anthropic's shape
    assert refused.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("root_path", ["llm", "/llm/"])
def test_a_root_path_must_be_a_path_prefix(tiny_demo_model, root_path):
    with pytest.raises(ConfigError, match="--root-path"):
        GatewayConfig.from_args(["--model", str(tiny_demo_model), "--tokenizer", "t:1", "--prefill", "p:1",
                                 "--decode", "d:1", "--root-path", root_path], {})


def test_the_reply_takes_the_response_role_or_the_continued_messages(mesh, flagged_client):
    kwargs = dict(model=mesh.model_name, max_tokens=3, temperature=0)
    assert flagged_client.chat.completions.create(messages=MESSAGES, **kwargs).choices[0].message.role == "model"
    [first, *_] = flagged_client.chat.completions.create(messages=MESSAGES, stream=True, **kwargs)
    assert first.choices[0].delta.role == "model"
    continued = [*MESSAGES, {"role": "assistant", "content": "It is"}]
    reply = flagged_client.chat.completions.create(
        messages=continued, extra_body={"add_generation_prompt": False, "continue_final_message": True}, **kwargs)
    assert reply.choices[0].message.role == "assistant"


def test_logprobs_name_tokens_by_id_unless_the_request_says_otherwise(mesh, flagged_client):
    kwargs = dict(model=mesh.model_name, prompt="Once upon a time", max_tokens=3, temperature=0, logprobs=2)
    by_id = flagged_client.completions.create(**kwargs).choices[0].logprobs
    assert all(token.startswith("token_id:") for token in by_id.tokens)
    assert all(name.startswith("token_id:") for top in by_id.top_logprobs for name in top)
    by_text = flagged_client.completions.create(**kwargs, extra_body={"return_tokens_as_token_ids": False})
    assert by_text.choices[0].logprobs.tokens == [
        flagged_client.post("/detokenize", cast_to=object, body={"tokens": [int(t.removeprefix("token_id:"))]})[
            "prompt"] for t in by_id.tokens]
    chat = flagged_client.chat.completions.create(model=mesh.model_name, messages=MESSAGES, max_tokens=2, logprobs=True)
    assert all(entry.token.startswith("token_id:") for entry in chat.choices[0].logprobs.content)


def test_tools_are_left_out_of_the_prompt_when_tool_choice_is_none(mesh, flagged, flagged_client):
    def prompt_tokens(**fields) -> int:
        return flagged_client.chat.completions.create(
            model=mesh.model_name, messages=MESSAGES, max_tokens=1,
            extra_body={"chat_template": TOOLS_TEMPLATE}, **fields).usage.prompt_tokens

    without_tools = prompt_tokens()
    assert prompt_tokens(tools=TOOLS, tool_choice="none") == without_tools
    forced = {"type": "function", "function": {"name": "get_time"}}
    assert prompt_tokens(tools=TOOLS, tool_choice=forced) > without_tools  # a used tool list is shown
    with grpc.insecure_channel(flagged.grpc_address) as channel:
        stub = gateway_pb2_grpc.GenerateStub(channel)

        def grpc_prompt_tokens(**fields) -> int:
            chat = common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(**m) for m in MESSAGES])
            [answer] = stub.Generate(gateway_pb2.GenerateRequest(
                chat=chat, chat_options=gateway_pb2.ChatOptions(chat_template=TOOLS_TEMPLATE),
                sampling=common_pb2.SamplingParams(max_tokens=1), **fields),
                metadata=[("authorization", f"Bearer {KEY}")], timeout=30)
            return answer.complete.usage.prompt_tokens

        assert grpc_prompt_tokens(tools_json=json.dumps(TOOLS), tool_choice_json='"none"') == without_tools
        assert grpc_prompt_tokens(tools_json=json.dumps(TOOLS), tool_choice_json=json.dumps(forced)) > without_tools
    mesh.assert_decode_pools_free()


def check_metrics_against_the_ledger(metrics: dict, timeline: dict, num_tokens: int) -> None:
    """vLLM's figures, from the engine's queue on: where the ledger says the prompt waited and was
    computed (the phases before the first token: the gateway's, the way to the worker, its queue)."""
    [choice] = timeline["choices"]
    phases, legs = choice["phases_ms"], choice.get("rpc_legs_ms") or {}
    waits = ("prefill_queue", "host_tier_read", "prefill_admit") if choice["prefilled_on"] == "prefill" \
        else ("decode_queue",)
    assert metrics["queue_time_ms"] == pytest.approx(sum(phases[p] for p in waits), abs=0.01)
    to_first_token = sum(phases[p] for p in ("ingress", "tokenize", "route", "prefill_queue", "host_tier_read",
                                             "prefill_admit", "prefill_compute", "rpc"))
    if choice["prefilled_on"] == "decode":
        to_first_token += phases["decode_queue"]
    before_queue = phases["ingress"] + phases["tokenize"] + phases["route"] + legs.get("to_prefill", 0.0)
    # A decode worker's chunk is marked as it is read, the token timed as the gateway takes it up:
    # the moment between is the ledger's `first_token`.
    scheduled_to_first_token = to_first_token - before_queue - metrics["queue_time_ms"]
    assert scheduled_to_first_token - 0.01 <= metrics["time_to_first_token_ms"] \
        <= scheduled_to_first_token + phases["first_token"] + 0.01
    assert metrics["time_to_first_token_ms"] > phases["prefill_compute"] > 0
    # (0 when every token came at once: the gateway times tokens as the workers' chunks bring them.)
    assert 0 <= metrics["generation_time_ms"] < choice["e2e_ms"] - to_first_token
    assert metrics["mean_itl_ms"] == pytest.approx(metrics["generation_time_ms"] / (num_tokens - 1), abs=0.01)
    assert metrics["tokens_per_second"] == pytest.approx(
        num_tokens * 1e3 / (metrics["time_to_first_token_ms"] + metrics["generation_time_ms"]), rel=1e-3)


def test_a_reply_of_one_sequence_carries_its_timing_with_per_request_metrics(mesh, client, flagged_client):
    kwargs = dict(model=mesh.model_name, max_tokens=6, temperature=0, extra_body={"ignore_eos": True,
                                                                                   "return_timeline": True})
    places = set()
    for prompt in ("Once upon a time", "word " * 400):  # prefilled on the decode worker, then on a prefill worker
        reply = flagged_client.completions.create(prompt=prompt, **kwargs).model_dump()
        check_metrics_against_the_ledger(reply["metrics"], reply["timeline"], num_tokens=6)
        places.add(reply["timeline"]["choices"][0]["prefilled_on"])
    assert places == {"decode", "prefill"}
    chat = flagged_client.chat.completions.create(messages=MESSAGES, **kwargs).model_dump()
    check_metrics_against_the_ledger(chat["metrics"], chat["timeline"], num_tokens=6)
    one = flagged_client.chat.completions.create(messages=MESSAGES, **{**kwargs, "max_tokens": 1}).model_dump()
    assert one["metrics"]["mean_itl_ms"] is None and one["metrics"]["generation_time_ms"] == 0.0
    assert one["metrics"]["time_to_first_token_ms"] > 0
    # Several sequences: their timings are no one request's.
    assert flagged_client.completions.create(prompt="Once", n=2, **kwargs).model_dump()["metrics"] is None
    assert flagged_client.completions.create(prompt=["Once", "Twice"], **kwargs).model_dump()["metrics"] is None
    # Streamed: on the usage chunk.
    chunks = list(flagged_client.chat.completions.create(messages=MESSAGES, stream=True, **kwargs,
                                                         stream_options={"include_usage": True}))
    usage_chunk = next(c for c in chunks if c.usage is not None)
    assert set(usage_chunk.model_extra["metrics"]) == {"time_to_first_token_ms", "generation_time_ms",
                                                       "queue_time_ms", "mean_itl_ms", "tokens_per_second"}
    assert usage_chunk.model_extra["metrics"]["tokens_per_second"] > 0
    assert all("metrics" not in (c.model_extra or {}) for c in chunks if c is not usage_chunk)
    response = flagged_client.responses.create(model=mesh.model_name, input="Hello", max_output_tokens=4)
    assert response.model_extra["metrics"]["tokens_per_second"] > 0
    # Without the flag, no `metrics`.
    assert "metrics" not in client.chat.completions.create(messages=MESSAGES, **kwargs).model_extra


def as_vllm_serializes(value):
    """transformers' loaded value as vLLM's /tokenizer_info writes it: an AddedToken as its text."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(key): as_vllm_serializes(item) for key, item in value.items()}
    if isinstance(value, list):
        return [as_vllm_serializes(item) for item in value]
    return value


def test_tokenizer_info_is_the_tokenizers_configuration_as_transformers_loads_it(mesh, flagged):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(mesh.model_dir))
    info = httpx.get(f"{flagged.base_url}/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=10).json()
    configured = json.loads((mesh.model_dir / "tokenizer_config.json").read_text())
    assert info["chat_template"] == hf.chat_template and info["tokenizer_class"] == configured["tokenizer_class"]
    for name in configured.keys() - {"chat_template", "tokenizer_class"}:
        assert info[name] == as_vllm_serializes(hf.init_kwargs[name]), name
    assert info["eos_token"] == hf.eos_token
    assert not {"vocab_file", "merges_file", "tokenizer_file"} & info.keys()
    unserved = httpx.get(f"{mesh.gateway.base_url}/tokenizer_info", timeout=10)
    assert unserved.status_code == 404  # off by default, as in vLLM


def test_auto_tool_choice_is_taken_as_vllm_takes_it_with_a_parser(tiny_demo_model):
    common = ["--model", str(tiny_demo_model), "--tokenizer", "t:1", "--prefill", "p:1", "--decode", "d:1"]
    config = GatewayConfig.from_args([*common, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"], {})
    assert config.tool_call_parser == "hermes"
    with pytest.raises(ConfigError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        GatewayConfig.from_args([*common, "--enable-auto-tool-choice"], {})
