"""The public gRPC `Generate` API from a plain grpcio client: text, chat and token ids in;
chunks then the completion out; errors as the stream's last message; cancellation frees pages."""
from __future__ import annotations

import json
import re

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.tokenizer.model_tokenizer import ModelTokenizer
from tests.unit.test_grammar_guides import DATE_GRAMMARS

PROMPT = "The quick brown fox jumps over the lazy dog, and then"


@pytest.fixture(scope="module")
def stub(mesh):
    with grpc.insecure_channel(mesh.gateway.grpc_address) as channel:
        yield gateway_pb2_grpc.GenerateStub(channel)


def greedy(max_tokens: int, **kwargs) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def http_text(mesh, prompt: str, max_tokens: int) -> str:
    response = httpx.post(f"{mesh.gateway.base_url}/v1/completions", timeout=30, json={
        "model": mesh.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    return response.json()["choices"][0]["text"]


def test_streamed_and_whole_outputs_agree_with_the_http_api(stub, mesh):
    request = gateway_pb2.GenerateRequest(request_id="grpc-1", model=mesh.model_name, text=PROMPT,
                                          sampling=greedy(12), stream_options=gateway_pb2.StreamOptions(stream=True))
    responses = list(stub.Generate(request, timeout=30))
    assert all(r.request_id == "grpc-1" for r in responses)
    chunks, last = responses[:-1], responses[-1]
    assert all(r.WhichOneof("response") == "chunk" for r in chunks)
    assert last.WhichOneof("response") == "complete"
    assert last.complete.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert last.complete.usage.completion_tokens == 12
    assert sum(len(r.chunk.token_ids) for r in chunks) == 12
    text = "".join(r.chunk.text for r in chunks)
    assert text == http_text(mesh, PROMPT, 12)

    whole = list(stub.Generate(gateway_pb2.GenerateRequest(request_id="grpc-2", text=PROMPT, sampling=greedy(12)),
                               timeout=30))
    assert len(whole) == 1 and whole[0].complete.text == text
    assert len(whole[0].complete.token_ids) == 12


def test_n_choices_are_the_http_apis_each_named_by_its_index(stub, mesh):
    """n seeded choices, streamed and whole: each choice the HTTP API's of the same index (choice i samples
    with seed + i), its chunks and its complete named by it, the stream ending after the last complete."""
    sampling = common_pb2.SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    expected = httpx.post(f"{mesh.gateway.base_url}/v1/completions", timeout=30, json={
        "model": mesh.model_name, "prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 7, "n": 3,
        "ignore_eos": True}).json()["choices"]
    texts = [choice["text"] for choice in sorted(expected, key=lambda choice: choice["index"])]
    assert len(set(texts)) == 3  # the seeds differ by choice
    responses = list(stub.Generate(gateway_pb2.GenerateRequest(
        request_id="grpc-n", text=PROMPT, sampling=sampling, n=3, stream_options=gateway_pb2.StreamOptions(
            stream=True)), timeout=30))
    completes = [r.complete for r in responses if r.WhichOneof("response") == "complete"]
    assert responses[-1].WhichOneof("response") == "complete"
    assert sorted(c.index for c in completes) == [0, 1, 2]
    assert all(c.usage.completion_tokens == 10 for c in completes)
    streamed = ["".join(r.chunk.text for r in responses if r.WhichOneof("response") == "chunk" and r.chunk.index == i)
                for i in range(3)]
    assert streamed == texts
    whole = list(stub.Generate(gateway_pb2.GenerateRequest(text=PROMPT, sampling=sampling, n=3), timeout=30))
    assert sorted((r.complete.index, r.complete.text) for r in whole) == list(enumerate(texts))
    chat = common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="user", content="Hello")])
    replies = list(stub.Generate(gateway_pb2.GenerateRequest(chat=chat, sampling=sampling, n=2), timeout=30))
    assert sorted(r.complete.index for r in replies) == [0, 1] and all(r.complete.text for r in replies)
    mesh.assert_decode_pools_free()


def test_a_grpc_request_ledger_is_served_by_its_request_id_and_its_timing_is_in_its_complete(stub, mesh):
    replies = list(stub.Generate(gateway_pb2.GenerateRequest(
        request_id="grpc-ledger", text=PROMPT, sampling=greedy(4),
        stream_options=gateway_pb2.StreamOptions(stream=True)), timeout=30))
    ledger = httpx.get(f"{mesh.gateway.base_url}/v1/requests/grpc-ledger/timeline", timeout=10).json()
    (choice,) = ledger["choices"]
    assert choice["request_id"] == "grpc-ledger" and choice["status"] == "finished"
    assert choice["prefilled_on"] in ("prefill", "decode")
    phases = choice["phases_ms"]
    assert phases["prefill_compute"] > 0 and phases["first_token"] > 0
    assert abs(sum(phases.values()) - choice["e2e_ms"]) < 1.0
    metrics = replies[-1].complete.metrics  # as the HTTP API's `metrics` (test_vllm_serving_flags.py)
    assert phases["prefill_compute"] < metrics.time_to_first_token_ms < choice["e2e_ms"]
    assert metrics.mean_itl_ms == pytest.approx(metrics.generation_time_ms / 3, abs=0.01)
    assert metrics.tokens_per_second == pytest.approx(
        4e3 / (metrics.time_to_first_token_ms + metrics.generation_time_ms), rel=1e-3)
    assert metrics.HasField("queue_time_ms")
    [one] = [r.complete for r in stub.Generate(gateway_pb2.GenerateRequest(text=PROMPT, sampling=greedy(1)),
                                               timeout=30) if r.HasField("complete")]
    assert not one.metrics.HasField("mean_itl_ms") and one.metrics.generation_time_ms == 0.0


def test_chat_and_token_ids_inputs_with_logprobs_and_stop(stub, mesh):
    chat = common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="user", content="Hello")])
    [response] = stub.Generate(gateway_pb2.GenerateRequest(chat=chat, sampling=greedy(6, logprobs=2)), timeout=30)
    assert len(response.complete.logprobs) == 6
    assert all(len(entry.top) == 2 for entry in response.complete.logprobs)
    assert response.request_id  # one was made for the request

    ids = gateway_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(token_ids=[5, 6, 7, 8]), sampling=greedy(20))
    [free] = stub.Generate(ids, timeout=30)
    stop = free.complete.text[4:7]
    ids.stop.append(stop)
    [stopped] = stub.Generate(ids, timeout=30)
    assert stopped.complete.text == free.complete.text[: free.complete.text.index(stop)]
    assert stopped.complete.finish_reason == common_pb2.FINISH_REASON_STOP
    assert stopped.complete.matched_stop == stop
    # A stop regex, as the HTTP APIs take SGLang's: fixed length, so its first match to complete is its first.
    del ids.stop[:]
    pattern = re.escape(stop[:2]) + "."
    ids.stop_regex.append(pattern)
    [by_regex] = stub.Generate(ids, timeout=30)
    start = re.search(pattern, free.complete.text).start()
    assert by_regex.complete.text == free.complete.text[:start] and by_regex.complete.matched_stop == pattern


def test_logit_bias_bans_tokens_throughout(stub):
    prompt = common_pb2.TokenIds(token_ids=[5, 6, 7, 8, 9])
    [plain] = stub.Generate(gateway_pb2.GenerateRequest(token_ids=prompt, sampling=greedy(6)), timeout=30)
    banned_ids = set(plain.complete.token_ids)
    [banned] = stub.Generate(gateway_pb2.GenerateRequest(
        token_ids=prompt, sampling=greedy(6, logit_bias={t: -100.0 for t in banned_ids})), timeout=30)
    assert len(banned.complete.token_ids) == 6 and banned_ids.isdisjoint(banned.complete.token_ids)


def test_errors_end_the_stream_with_an_error_message(stub, mesh):
    cases = [
        (gateway_pb2.GenerateRequest(model="nope", text="hi"), 404),
        (gateway_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(temperature=-1)), 400),
        (gateway_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(temperature=float("nan"))), 400),
        (gateway_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(repetition_penalty=float("inf"))),
         400),
        (gateway_pb2.GenerateRequest(text="word " * 3000), 400),
        (gateway_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(token_ids=[5, 6, -1])), 400),
        # A negative id where the gateway reads the ids itself: the prompt's tail (decoded ahead), its first
        # block (hashed to route it), a later block (hashed once it is sent).
        (gateway_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(token_ids=[*range(100, 140), -7, 5])), 400),
        (gateway_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(token_ids=[-1, *range(100, 140)])), 400),
        (gateway_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(token_ids=[*range(100, 120), -2,
                                                                             *range(100, 130)])), 400),
        (gateway_pb2.GenerateRequest(), 400),
        (gateway_pb2.GenerateRequest(text="hi", n=129), 400),
        (gateway_pb2.GenerateRequest(text="hi", stop_regex=["("]), 400),
        (gateway_pb2.GenerateRequest(text="hi", stop_regex=["x?"]), 400),
        (gateway_pb2.GenerateRequest(text="hi", stop_regex=["x"], beam_search=gateway_pb2.BeamSearch()), 400),
        # Chat held to what the HTTP API takes: a role OpenAI's API knows, at least one message.
        (gateway_pb2.GenerateRequest(chat=common_pb2.ChatMessages(messages=[
            common_pb2.ChatMessage(role="user", content="hi"), common_pb2.ChatMessage(role="narrator", content="x")])),
         400),
        (gateway_pb2.GenerateRequest(chat=common_pb2.ChatMessages()), 400),
        (gateway_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(logit_bias={5: 100.5})), 400),
        (gateway_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(logit_bias={-3: 1})), 400),
        (gateway_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(logit_bias={99999: 1})), 400),
        (gateway_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(guided_grammar='start: "a" b')),
         400),
        (gateway_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(guided_grammar='start: "a"',
                                                                                   guided_regex="a")), 400),
        # A continued last message, with the generation prompt on by default; template variables not JSON.
        (gateway_pb2.GenerateRequest(chat=common_pb2.ChatMessages(messages=[
            common_pb2.ChatMessage(role="user", content="hi")]), chat_options=gateway_pb2.ChatOptions(
                continue_final_message=True)), 400),
        (gateway_pb2.GenerateRequest(chat=common_pb2.ChatMessages(messages=[
            common_pb2.ChatMessage(role="user", content="hi")]), chat_options=gateway_pb2.ChatOptions(
                chat_template_kwargs_json="{oops")), 400),
    ]
    for request, code in cases:
        [response] = stub.Generate(request, timeout=30)
        assert response.WhichOneof("response") == "error", response
        assert response.error.code == code and response.error.message
    mesh.assert_decode_pools_free()


@pytest.mark.parametrize(("sampling", "param"), [
    (common_pb2.SamplingParams(temperature=-1), "temperature"),
    (common_pb2.SamplingParams(top_p=float("nan")), "top_p"),
    (common_pb2.SamplingParams(repetition_penalty=float("inf")), "repetition_penalty"),
    (common_pb2.SamplingParams(logit_bias={5: 100.5}), "logit_bias"),
    (common_pb2.SamplingParams(logit_bias={99999: 1}), "logit_bias"),  # past the vocabulary: the engine's check
    (common_pb2.SamplingParams(stop_token_ids=[99999]), "stop_token_ids"),
    (common_pb2.SamplingParams(guided_regex="("), "guided_regex"),
])
def test_a_refused_sampling_parameter_is_the_errors_param(stub, sampling, param):
    [response] = stub.Generate(gateway_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(token_ids=[5, 6, 7]),
                                                           sampling=sampling), timeout=30)
    assert response.error.code == 400 and response.error.param == param, response


def test_a_cancelled_call_frees_its_pages(stub, mesh):
    call = stub.Generate(gateway_pb2.GenerateRequest(text=PROMPT, sampling=greedy(1900),
                                                     stream_options=gateway_pb2.StreamOptions(stream=True)))
    next(call)
    call.cancel()
    mesh.assert_decode_pools_free(within_s=1.0)


def test_health_and_reflection_list_the_generate_service(mesh):
    with grpc.insecure_channel(mesh.gateway.grpc_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service="baton.gateway.v1.Generate"), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        [reply] = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        assert "baton.gateway.v1.Generate" in {s.name for s in reply.list_services_response.service}


def test_prompt_logprobs_come_with_the_first_chunk_as_the_http_api_gives_them(mesh, stub):
    ids = [(13 * j) % 900 + 5 for j in range(50)]
    request = gateway_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(token_ids=ids), sampling=greedy(
        3, prompt_logprobs=2), stream_options=gateway_pb2.StreamOptions(stream=True))
    responses = list(stub.Generate(request, timeout=60))
    first = responses[0].chunk.prompt_logprobs
    assert [e.sampled.token_id for e in first] == ids[1:]
    assert all(len(e.top) == 2 for e in first)
    assert not any(r.chunk.prompt_logprobs for r in responses[1:-1])
    whole = next(iter(stub.Generate(gateway_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(token_ids=ids), sampling=greedy(3, prompt_logprobs=2)), timeout=60)))
    assert list(whole.complete.prompt_logprobs) == list(first)
    http = httpx.post(f"{mesh.gateway.base_url}/v1/completions", timeout=30, json={
        "model": mesh.model_name, "prompt": ids, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
        "prompt_logprobs": 2}).json()["choices"][0]["prompt_logprobs"]
    assert [record[str(e.sampled.token_id)]["logprob"] for record, e in zip(http[1:], first)] == pytest.approx(
        [e.sampled.logprob for e in first], abs=1e-6)
    mesh.assert_decode_pools_free()


def test_allowed_token_ids_bound_every_token_on_prefill_and_decode(mesh, stub):
    for sampling in (greedy(8, allowed_token_ids=[300, 301]),
                     common_pb2.SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True,
                                               allowed_token_ids=[300, 301])):
        responses = list(stub.Generate(gateway_pb2.GenerateRequest(text=PROMPT, sampling=sampling), timeout=60))
        tokens = responses[-1].complete.token_ids
        assert len(tokens) == 8 and set(tokens) <= {300, 301}
    mesh.assert_decode_pools_free()


def test_a_grammar_holds_the_text_on_prefill_and_decode(mesh, stub):
    date = r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]"
    sampling = common_pb2.SamplingParams(max_tokens=30, temperature=1.0, seed=6, guided_grammar=DATE_GRAMMARS["gbnf"])
    [whole] = stub.Generate(gateway_pb2.GenerateRequest(text=PROMPT, sampling=sampling), timeout=60)
    assert re.fullmatch(date, whole.complete.text) and whole.complete.finish_reason == common_pb2.FINISH_REASON_STOP
    mesh.assert_decode_pools_free()


def test_the_http_apis_text_and_chat_options(mesh, stub):
    messages = [{"role": "user", "content": "Name three colours."}, {"role": "assistant", "content": "Red, green and"}]
    http = httpx.post(f"{mesh.gateway.base_url}/v1/chat/completions", timeout=30, json={
        "model": mesh.model_name, "messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
        "add_generation_prompt": False, "continue_final_message": True}).json()
    chat = common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(**m) for m in messages])
    [continued] = stub.Generate(gateway_pb2.GenerateRequest(chat=chat, sampling=greedy(4), chat_options=(
        gateway_pb2.ChatOptions(add_generation_prompt=False, continue_final_message=True))), timeout=30)
    assert continued.complete.usage.prompt_tokens == http["usage"]["prompt_tokens"]
    assert continued.complete.text == http["choices"][0]["message"]["content"]
    [started] = stub.Generate(gateway_pb2.GenerateRequest(chat=chat, sampling=greedy(4)), timeout=30)
    assert started.complete.usage.prompt_tokens != continued.complete.usage.prompt_tokens

    ids = gateway_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(token_ids=[5, 6, 7, 8]), sampling=greedy(20))
    [free] = stub.Generate(ids, timeout=30)
    stop = free.complete.text[4:7]
    ids.stop.append(stop)
    ids.include_stop_str_in_output = True
    [stopped] = stub.Generate(ids, timeout=30)
    assert stopped.complete.text == free.complete.text[: free.complete.text.index(stop) + len(stop)]

    eos = ModelTokenizer.from_dir(mesh.model_dir).eos_token_ids[0]  # forced three times, EOS ignored
    forced = gateway_pb2.GenerateRequest(text=PROMPT, sampling=greedy(3, logit_bias={eos: 100.0}))
    [skipped] = stub.Generate(forced, timeout=30)
    forced.skip_special_tokens = False
    [kept] = stub.Generate(forced, timeout=30)
    assert list(kept.complete.token_ids) == [eos] * 3 and skipped.complete.text == "" and kept.complete.text
    mesh.assert_decode_pools_free()


TIME_TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
ASK_TIME = common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="user", content="What time is it?")])


def tools_request(choice, stream: bool = False, max_tokens: int = 60, **fields) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        chat=fields.pop("chat", ASK_TIME), sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0),
        tools_json=json.dumps(TIME_TOOLS), tool_choice_json=json.dumps(choice),
        stream_options=gateway_pb2.StreamOptions(stream=stream), **fields)


def test_tools_forced_by_tool_choice_come_back_as_tool_calls(stub, mesh, client):
    named = {"type": "function", "function": {"name": "get_time"}}
    [whole] = stub.Generate(tools_request(named), timeout=30)
    [call] = whole.complete.tool_calls
    assert call.name == "get_time" and call.id.startswith("call_") and not whole.complete.text
    assert json.loads(call.arguments)["zone"] in ("UTC", "CET")
    assert whole.complete.finish_reason == common_pb2.FINISH_REASON_STOP  # a named function's call, as OpenAI's
    http = client.chat.completions.create(model=mesh.model_name, messages=[{"role": "user", "content":
                                          "What time is it?"}], max_tokens=60, temperature=0, tools=TIME_TOOLS,
                                          tool_choice=named).choices[0].message.tool_calls[0]
    assert call.arguments == http.function.arguments

    pieces = [r.chunk.tool_calls for r in stub.Generate(tools_request(named, stream=True), timeout=30)
              if r.HasField("chunk")]
    first, *rest = [c for piece in pieces for c in piece]
    assert first.name == "get_time" and first.id and all(c.index == 0 and not c.name for c in rest)
    assert first.arguments + "".join(c.arguments for c in rest) == call.arguments

    [required] = stub.Generate(tools_request("required", max_tokens=300), timeout=60)
    assert required.complete.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    assert required.complete.tool_calls and {c.name for c in required.complete.tool_calls} == {"get_time"}

    # The next turn: the call and its answer go back in, and the reply is text.
    follow_up = common_pb2.ChatMessages(messages=[
        *ASK_TIME.messages,
        common_pb2.ChatMessage(role="assistant", tool_calls_json=json.dumps([{
            "id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}])),
        common_pb2.ChatMessage(role="tool", tool_call_id=call.id, content="12:00")])
    [reply] = stub.Generate(tools_request("none", chat=follow_up), timeout=30)
    assert reply.complete.text and not reply.complete.tool_calls
    mesh.assert_decode_pools_free()


@pytest.mark.parametrize(("fields", "param"), [
    ({"tool_choice_json": '"auto"'}, "tool_choice_json"),  # this gateway has no tool-call parser
    ({"tools_json": "[{"}, "tools_json"),
    ({"tools_json": '{"type": "function"}'}, "tools_json"),
    ({"tools_json": "[1]"}, "tools_json"),  # a 500 before (found by fuzzing the gRPC API's fields)
    ({"tool_choice_json": '{"type": "function", "function": {"name": "nope"}}'}, "tool_choice_json"),
])
def test_tools_that_cannot_be_served_are_a_400(stub, mesh, fields, param):
    request = tools_request("required")
    for name, value in fields.items():
        setattr(request, name, value)
    [response] = stub.Generate(request, timeout=30)
    assert response.error.code == 400 and response.error.param == param, response


def test_an_earlier_turns_calls_that_are_not_objects_are_a_400(stub):
    """A 500 before (found by fuzzing the gRPC API's fields): tool_calls_json a list, but not of objects."""
    chat = common_pb2.ChatMessages(messages=[*ASK_TIME.messages, common_pb2.ChatMessage(role="assistant",
                                                                                       tool_calls_json="[1]")])
    [response] = stub.Generate(tools_request("none", chat=chat), timeout=30)
    assert response.error.code == 400 and response.error.param == "chat.messages", response
