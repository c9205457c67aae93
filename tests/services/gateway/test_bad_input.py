"""Bad input through real HTTP: each gets OpenAI's error object with the right status, and
none leaves a decode page reserved. Clients that go away free their pages within a second."""
from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from protos import decode_pb2, decode_pb2_grpc
from tests.services.gateway.mesh import WHOLE_POOL_TOKENS, gateway_client, metric_value

LONG_PROMPT = "word " * 3000  # well over the 2048-token context


def post(mesh, path: str, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{mesh.gateway.base_url}{path}", content=content,
                      headers={"content-type": "application/json"}, timeout=30, **kwargs)


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


CASES = [
    # (name, path, body, status, param)
    ("malformed json", "/v1/completions", b'{"model": "x", "prompt": ', 400, None),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("no body", "/v1/completions", b"", 400, None),
    ("missing prompt", "/v1/completions", {"model": "MODEL"}, 400, "prompt"),
    ("missing model", "/v1/completions", {"prompt": "hi"}, 400, "model"),
    ("missing messages", "/v1/chat/completions", {"model": "MODEL"}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", {"model": "MODEL", "messages": []}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"model": "MODEL", "messages": [{"role": "wizard", "content": "x"}]},
     400, None),
    ("max_tokens 0", "/v1/completions", {"model": "MODEL", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens 0 with best_of", "/v1/completions",
     {"model": "MODEL", "prompt": "hi", "max_tokens": 0, "echo": True, "best_of": 2}, 400, "max_tokens"),
    ("max_tokens 0 with beam search", "/v1/completions",
     {"model": "MODEL", "prompt": "hi", "max_tokens": 0, "echo": True, "use_beam_search": True}, 400, "max_tokens"),
    ("max_completion_tokens -1", "/v1/chat/completions",
     {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}, 400,
     "max_completion_tokens"),
    ("temperature < 0", "/v1/completions", {"model": "MODEL", "prompt": "hi", "temperature": -0.5}, 400,
     "temperature"),
    ("temperature Infinity", "/v1/completions", b'{"model": "MODEL", "prompt": "hi", "temperature": Infinity}', 400,
     "temperature"),
    ("repetition_penalty NaN", "/v1/completions",
     b'{"model": "MODEL", "prompt": "hi", "repetition_penalty": NaN}', 400, "repetition_penalty"),
    ("top_p 0", "/v1/completions", {"model": "MODEL", "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("seed under int64", "/v1/completions", {"model": "MODEL", "prompt": "hi", "seed": -2**63 - 1}, 400, "seed"),
    ("top_p 1.5", "/v1/completions", {"model": "MODEL", "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("top_k -2", "/v1/completions", {"model": "MODEL", "prompt": "hi", "top_k": -2}, 400, "top_k"),
    # Past what the protos carry: refused, not an overflow inside the gateway.
    ("top_k past int32", "/v1/completions", {"model": "MODEL", "prompt": "hi", "top_k": 2**40}, 400, "top_k"),
    ("max_tokens past uint32", "/v1/completions", {"model": "MODEL", "prompt": "hi", "max_tokens": 2**40}, 400,
     "max_tokens"),
    ("max_completion_tokens past uint32", "/v1/chat/completions",
     {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2**40}, 400,
     "max_completion_tokens"),
    ("stop_token_ids past int32", "/v1/completions", {"model": "MODEL", "prompt": "hi", "stop_token_ids": [2**40]},
     400, None),
    ("stop_token_ids past the vocabulary", "/v1/completions",
     {"model": "MODEL", "prompt": "hi", "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    ("min_tokens over max_tokens", "/v1/completions",
     {"model": "MODEL", "prompt": "hi", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    ("continue_final_message with add_generation_prompt", "/v1/chat/completions",
     {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, 400, None),
    ("chat_template_kwargs naming a request field", "/v1/chat/completions",
     {"model": "MODEL", "messages": [{"role": "user", "content": "x"}],
      "chat_template_kwargs": {"add_generation_prompt": False}}, 400, None),
    ("allowed_token_ids empty", "/v1/completions", {"model": "MODEL", "prompt": "hi", "allowed_token_ids": []}, 400,
     "allowed_token_ids"),
    ("allowed_token_ids past the vocabulary", "/v1/completions",
     {"model": "MODEL", "prompt": "hi", "allowed_token_ids": [5, 10**6]}, 400, "allowed_token_ids"),
    ("truncate_prompt_tokens 0", "/v1/completions", {"model": "MODEL", "prompt": "hi", "truncate_prompt_tokens": 0},
     400, "truncate_prompt_tokens"),
    ("truncate_prompt_tokens -2", "/v1/completions",
     {"model": "MODEL", "prompt": "hi", "truncate_prompt_tokens": -2}, 400, "truncate_prompt_tokens"),
    ("echo with truncate_prompt_tokens", "/v1/completions",
     {"model": "MODEL", "prompt": "hi", "echo": True, "truncate_prompt_tokens": 1}, 400, None),
    ("a regex that does not compile", "/v1/completions", {"model": "MODEL", "prompt": "hi", "guided_regex": "(a"},
     400, None),
    ("a JSON schema outlines cannot use", "/v1/chat/completions",
     {"model": "MODEL", "messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, 400,
     "response_format"),
    ("response_format of an unknown type", "/v1/chat/completions",
     {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, 400,
     "response_format"),
    ("two structured outputs at once", "/v1/completions",
     {"model": "MODEL", "prompt": "hi", "guided_regex": "a", "guided_choice": ["b"]}, 400, "guided_choice"),
    ("a tool that is not a function", "/v1/chat/completions",
     {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "retrieval"}],
      "tool_choice": "required"}, 400, None),
    ("tool_choice without tools", "/v1/chat/completions",
     {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400, None),
    ("prompt_logprobs 21", "/v1/completions", {"model": "MODEL", "prompt": "hi", "prompt_logprobs": 21}, 400,
     "prompt_logprobs"),
    ("min_tokens negative", "/v1/chat/completions",
     {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "min_tokens": -1}, 400, "min_tokens"),
    ("presence_penalty 3", "/v1/completions", {"model": "MODEL", "prompt": "hi", "presence_penalty": 3}, 400,
     "presence_penalty"),
    ("logprobs 21", "/v1/completions", {"model": "MODEL", "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("empty stop", "/v1/completions", {"model": "MODEL", "prompt": "hi", "stop": [""]}, 400, "stop"),
    ("n 129", "/v1/completions", {"model": "MODEL", "prompt": "hi", "n": 129}, 400, "n"),
    ("token id past the vocabulary", "/v1/completions", {"model": "MODEL", "prompt": [5, 6, 10**6]}, 400, None),
    ("negative token id", "/v1/completions", {"model": "MODEL", "prompt": [5, 6, -1]}, 400, "prompt"),
    ("token id past int32", "/v1/completions", {"model": "MODEL", "prompt": [5, 2**40]}, 400, "prompt"),
    ("empty prompt list", "/v1/completions", {"model": "MODEL", "prompt": []}, 400, "prompt"),
    ("fractional token ids", "/v1/completions", {"model": "MODEL", "prompt": [5, 6.5]}, 400, "prompt"),
    ("boolean token ids", "/v1/completions", {"model": "MODEL", "prompt": [True, 6]}, 400, "prompt"),
    ("ids and text mixed", "/v1/completions", {"model": "MODEL", "prompt": [5, "six"]}, 400, "prompt"),
    ("image content", "/v1/chat/completions",
     {"model": "MODEL", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages.0"),
    ("logit_bias key not a token id", "/v1/completions", {"model": "MODEL", "prompt": "hi", "logit_bias": {"a": 1}},
     400, "logit_bias"),
    ("logit_bias 101", "/v1/completions", {"model": "MODEL", "prompt": "hi", "logit_bias": {"5": 101}}, 400,
     "logit_bias.5"),
    ("logit_bias past the vocabulary", "/v1/chat/completions",
     {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"5000": -100}}, 400,
     "logit_bias"),
    # vLLM's extras not served here: refused, not ignored (ignored, the output would not be what was asked for).
    ("beam search with stop strings", "/v1/completions",
     {"model": "MODEL", "prompt": "hi", "use_beam_search": True, "n": 2, "stop": "."}, 400, "stop"),
    ("a grammar that cannot be read", "/v1/completions",
     {"model": "MODEL", "prompt": "hi", "guided_grammar": 'root ::= "a" value'}, 400, None),
    ("a grammar that does not compile", "/v1/completions",
     {"model": "MODEL", "prompt": "hi", "guided_grammar": 'start: "a" value'}, 400, None),
    ("an empty grammar", "/v1/completions", {"model": "MODEL", "prompt": "hi", "guided_grammar": " "}, 400,
     "guided_grammar"),
    ("vLLM's prompt embeddings", "/v1/completions", {"model": "MODEL", "prompt": "hi", "prompt_embeds": "AAAA"}, 400,
     "prompt_embeds"),
    ("logits processors", "/v1/chat/completions", {"model": "MODEL", "messages": [{"role": "user", "content": "x"}],
                                                   "logits_processors": ["my.module:Processor"]}, 400,
     "logits_processors"),
    ("SGLang's hidden states", "/v1/chat/completions", {"model": "MODEL", "return_hidden_states": True,
                                                       "messages": [{"role": "user", "content": "x"}]}, 400,
     "return_hidden_states"),
    ("SGLang's logit processor", "/v1/completions", {"model": "MODEL", "prompt": "hi",
                                                    "custom_logit_processor": "{\"callable\": \"x\"}"}, 400,
     "custom_logit_processor"),
    ("a lora_path that names no adapter", "/v1/completions", {"model": "MODEL", "prompt": "hi",
                                                             "lora_path": "no-such-adapter"}, 404, None),
    ("a structural tag without triggers", "/v1/chat/completions",
     {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "response_format": {
         "type": "structural_tag", "structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}]}}, 400,
     "response_format"),
    ("a structural tag whose begin has no trigger", "/v1/completions",
     {"model": "MODEL", "prompt": "hi", "structured_outputs": {"structural_tag": json.dumps({
         "structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}], "triggers": ["<g"]})}}, 400,
     "structured_outputs.structural_tag"),
    ("a grammar and a regex", "/v1/completions",
     {"model": "MODEL", "prompt": "hi", "guided_regex": "a", "structured_outputs": {"grammar": 'root ::= "a"'}}, 400,
     "structured_outputs.grammar"),
    ("a blank bad word", "/v1/completions", {"model": "MODEL", "prompt": "hi", "bad_words": ["a", " "]}, 400,
     "bad_words"),
    ("structured_outputs and guided_regex", "/v1/completions",
     {"model": "MODEL", "prompt": "hi", "guided_regex": "a", "structured_outputs": {"choice": ["b"]}}, 400,
     "structured_outputs.choice"),
    ("structured_outputs.choice empty", "/v1/completions",
     {"model": "MODEL", "prompt": "hi", "structured_outputs": {"choice": []}}, 400, "structured_outputs.choice"),
    ("stream_options without stream", "/v1/completions",
     {"model": "MODEL", "prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    # Checks of several fields at once still name the one to change.
    ("a forced call and a structured output", "/v1/chat/completions",
     {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"},
      "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, 400, "tool_choice"),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("suffix", "/v1/completions", {"model": "MODEL", "prompt": "hi", "suffix": "end"}, 400, "suffix"),
    # SGLang's rid goes back as the x-request-id header: one no header can carry was a dropped connection.
    ("a rid with a newline", "/v1/completions", {"model": "MODEL", "prompt": "hi", "rid": "a\nb"}, 400, "rid"),
    ("a rid with a NUL", "/v1/chat/completions",
     {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "rid": "\u0000", "stream": True}, 400, "rid"),
    ("a rid beyond Latin-1", "/v1/completions", {"model": "MODEL", "prompt": "hi", "rid": "漢"}, 400, "rid"),
    # Shapes within OpenAI's objects that were read as objects before they were checked (500s, found by fuzzing).
    ("a tool's function not an object", "/v1/chat/completions",
     {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": 1}]},
     400, None),
    ("a tool's parameters not an object", "/v1/chat/completions",
     {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, 400, None),
    ("tool_choice's function not an object", "/v1/chat/completions",
     {"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
         "name": "f"}}], "tool_choice": {"type": "function", "function": "f"}}, 400, None),
    ("json_schema not an object", "/v1/chat/completions",
     {"model": "MODEL", "messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": "x"}}, 400, "response_format"),
    ("a text part without text", "/v1/chat/completions",
     {"model": "MODEL", "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}, 400,
     "messages.0"),
    ("a text part without text, to /tokenize", "/tokenize",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}, 400, "messages.0"),
]


@pytest.mark.parametrize("name,path,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_an_openai_error(mesh, name, path, body, status, param):
    if isinstance(body, dict) and body.get("model") == "MODEL":
        body = {**body, "model": mesh.model_name}
    elif isinstance(body, bytes):
        body = body.replace(b'"MODEL"', json.dumps(mesh.model_name).encode())
    assert_openai_error(post(mesh, path, body), status, param)


def test_unknown_model_is_404_through_the_openai_client(mesh):
    with openai.OpenAI(base_url=f"{mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
        assert e.value.body["code"] == "model_not_found"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("no-such-model")
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=mesh.model_name, messages=[{"role": "user", "content": LONG_PROMPT}])
        assert e.value.body["code"] == "context_length_exceeded"


def test_a_wrong_method_is_405_naming_the_allowed_one_and_an_unknown_path_404(mesh):
    response = httpx.get(f"{mesh.gateway.base_url}/v1/completions", timeout=30)
    error = assert_openai_error(response, 405)
    assert error["type"] == "invalid_request_error"
    assert response.headers["allow"] == "POST"
    error = assert_openai_error(httpx.post(f"{mesh.gateway.base_url}/v1/nowhere", json={}, timeout=30), 404)
    assert error["type"] == "not_found_error"


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_over_the_context_is_400(mesh, stream):
    error = assert_openai_error(post(mesh, "/v1/completions", {"model": mesh.model_name, "prompt": LONG_PROMPT,
                                                               "stream": stream}),
                                400, "prompt", "context_length_exceeded")
    assert "maximum context length" in error["message"]
    prompt = [5] * 2000  # fits alone, not with the 100 tokens asked for
    assert_openai_error(post(mesh, "/v1/completions", {"model": mesh.model_name, "prompt": prompt,
                                                       "max_tokens": 100}), 400, "prompt", "context_length_exceeded")


def test_a_body_over_the_limit_is_413(mesh):
    big = {"model": mesh.model_name, "prompt": "x" * (9 * 2**20)}  # the default limit is 8 MiB
    assert_openai_error(post(mesh, "/v1/completions", big), 413, code="request_too_large")

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"model": "m", "prompt": "'
        for _ in range(10):
            yield b"x" * 2**20
        yield b'"}'
    response = httpx.post(f"{mesh.gateway.base_url}/v1/completions", content=chunks(),
                          headers={"content-type": "application/json"}, timeout=30)
    assert_openai_error(response, 413)


def test_no_free_pages_is_429_and_then_serving_resumes(mesh):
    stubs = [decode_pb2_grpc.DecodeStub(svc.channel) for svc in mesh.decode]
    for i, stub in enumerate(stubs):  # every page of every decode worker held
        stub.Reserve(decode_pb2.ReserveRequest(request_id=f"hog-{i}", num_tokens=WHOLE_POOL_TOKENS), timeout=5)
    try:
        # ignore_eos: a first token that ends the request (sampled at temperature 1) would need no pages.
        assert_openai_error(post(mesh, "/v1/completions", {"model": mesh.model_name, "prompt": "hi",
                                                          "ignore_eos": True}), 429, code="overloaded")
    finally:
        for i, stub in enumerate(stubs):
            stub.Abort(decode_pb2.AbortRequest(request_id=f"hog-{i}"), timeout=5)
    assert post(mesh, "/v1/completions", {"model": mesh.model_name, "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_prompt_whose_decode_worker_has_no_free_pages_moves_to_one_that_has(mesh):
    """Decode worker 0 full (this mesh's prefill workers wait for no pages): a request routed to it (every
    other one: ties go in turn) has its first token, then its Reserve refused there; it is prefilled again
    for worker 1, which has room, and answered whole, streamed or not, as one never moved; before, a 429
    (an error event after the first chunk) while another worker had room."""
    stub = decode_pb2_grpc.DecodeStub(mesh.decode[0].channel)
    stub.Reserve(decode_pb2.ReserveRequest(request_id="hog-one", num_tokens=WHOLE_POOL_TOKENS), timeout=5)
    moves = metric_value(mesh.gateway.base_url, "baton_gateway_full_decode_moves_total")
    body = {"model": mesh.model_name, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    try:
        replies = [post(mesh, "/v1/completions", body) for _ in range(2)]
        with httpx.stream("POST", f"{mesh.gateway.base_url}/v1/completions", json={**body, "stream": True},
                          timeout=30) as response:
            data = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
        replies.append(post(mesh, "/v1/completions", body))
    finally:
        stub.Abort(decode_pb2.AbortRequest(request_id="hog-one"), timeout=5)
    assert [reply.status_code for reply in replies] == [200] * 3, [reply.text for reply in replies]
    texts = {reply.json()["choices"][0]["text"] for reply in replies}
    assert data[-1] == "[DONE]" and all("error" not in json.loads(chunk) for chunk in data[:-1])
    texts.add("".join(json.loads(chunk)["choices"][0]["text"] for chunk in data[:-1]))
    assert len(texts) == 1 and len(replies[0].json()["choices"][0]["text"]) > 0
    assert metric_value(mesh.gateway.base_url, "baton_gateway_full_decode_moves_total") - moves >= 1
    mesh.assert_decode_pools_free()


def test_a_stream_whose_pages_cannot_be_reserved_sends_its_first_token_then_an_overloaded_error(mesh):
    stubs = [decode_pb2_grpc.DecodeStub(svc.channel) for svc in mesh.decode]
    for i, stub in enumerate(stubs):
        stub.Reserve(decode_pb2.ReserveRequest(request_id=f"hog-stream-{i}", num_tokens=WHOLE_POOL_TOKENS), timeout=5)
    try:
        # The prefill worker sends the first token before it reserves pages; the Reserve then fails.
        with httpx.stream("POST", f"{mesh.gateway.base_url}/v1/completions", timeout=30, json={
                "model": mesh.model_name, "prompt": "hi there", "max_tokens": 4, "stream": True,
                "ignore_eos": True}) as response:  # a first token that ends it would need no pages
            assert response.status_code == 200
            data = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    finally:
        for i, stub in enumerate(stubs):
            stub.Abort(decode_pb2.AbortRequest(request_id=f"hog-stream-{i}"), timeout=5)
    assert data[-1] == "[DONE]"
    first, error = json.loads(data[0]), json.loads(data[-2])
    assert first["choices"][0]["text"] is not None and "error" not in first
    assert error["error"]["code"] == "overloaded" and error["error"]["message"], error
    mesh.assert_decode_pools_free()


def test_bad_input_leaves_no_page_reserved(mesh):
    for name, path, body, _, _ in CASES:
        if isinstance(body, dict) and body.get("model") == "MODEL":
            body = {**body, "model": mesh.model_name}
        post(mesh, path, body)
    post(mesh, "/v1/completions", {"model": mesh.model_name, "prompt": LONG_PROMPT})
    mesh.assert_decode_pools_free()


def _raw_stream_request(mesh, body: dict) -> socket.socket:
    """A streaming POST on a raw socket, so the test decides exactly when the client vanishes."""
    host, port = mesh.gateway.http_address.rsplit(":", 1)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return sock


def test_a_client_that_disconnects_mid_stream_frees_its_pages_within_a_second(mesh):
    body = {"model": mesh.model_name, "prompt": "A long story begins", "max_tokens": 1900, "stream": True,
            "ignore_eos": True, "temperature": 0}
    socks = [_raw_stream_request(mesh, body) for _ in range(4)]
    for sock in socks:
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")  # streaming has begun
    for sock in socks:
        sock.close()
    closed = time.monotonic()
    mesh.assert_decode_pools_free(within_s=1.0)
    assert time.monotonic() - closed < 1.0


def test_a_client_that_disconnects_before_its_first_token_frees_its_pages(mesh):
    # A near-context prompt: the client is gone while it is tokenized, reserved or prefilled.
    body = {"model": mesh.model_name, "prompt": "many words " * 900, "max_tokens": 8, "stream": True}
    for delay_s in (0.0, 0.02, 0.1):
        sock = _raw_stream_request(mesh, body)
        time.sleep(delay_s)
        sock.close()
    mesh.assert_decode_pools_free(within_s=1.0)
    assert post(mesh, "/v1/completions", {"model": mesh.model_name, "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_request_id_reused_while_it_runs_is_served_each_time(mesh):
    """Requests sent at once under one x-request-id (a retry racing its original, a client's fixed id) are each
    served under it, the workers given ids of their own; before, the workers refused all but one as in use (a
    400), or a prefill worker admitted one beside the pages it still held for another of that id, and its engine
    failed on it, stopping the worker (and `baton up`, whole)."""
    body = {"model": mesh.model_name, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}
    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(lambda _: httpx.post(f"{mesh.gateway.base_url}/v1/completions", json=body, timeout=30,
                                                     headers={"x-request-id": "reused-id"}), range(6)))
    assert [reply.status_code for reply in replies] == [200] * 6, [reply.text for reply in replies]
    assert {reply.json()["id"] for reply in replies} == {"reused-id"}
    assert len({reply.json()["choices"][0]["text"] for reply in replies}) == 1
    assert all(worker.proc.poll() is None for worker in [*mesh.prefill, *mesh.decode])
    mesh.assert_decode_pools_free()


def test_a_request_id_sent_through_two_gateways_at_once_is_served_by_both(mesh):
    """Two gateways in front of the same workers, given one x-request-id at once (a proxy's retry through the
    other while the first try still runs): each serves it. Each gateway knows only its own running ids, and
    both routed it to the same workers, which refused the second as in use (a 400, or an error event after
    its first token) while each passed the client's id on as the workers' own."""
    body = {"model": mesh.model_name, "prompt": "Once upon a time", "max_tokens": 32, "temperature": 0,
            "ignore_eos": True}
    with gateway_client(mesh) as second:
        urls = [mesh.gateway.base_url, str(second.base_url).removesuffix("/v1/")]
        with ThreadPoolExecutor(2) as pool:
            for _ in range(3):
                replies = list(pool.map(lambda url: httpx.post(f"{url}/v1/completions", json=body, timeout=30,
                                                               headers={"x-request-id": "one-id"}), urls))
                assert [reply.status_code for reply in replies] == [200, 200], [reply.text for reply in replies]
                assert len({reply.json()["choices"][0]["text"] for reply in replies}) == 1
    mesh.assert_decode_pools_free()
