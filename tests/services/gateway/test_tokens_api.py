"""vLLM's tokens-in, tokens-out API (`POST /inference/v1/generate`) through the mesh: token ids in,
token ids out, equal to transformers' greedy tokens and to the completions API's, whole and streamed,
with logprobs named by id, n choices, usage, and its refusals; and vLLM's render endpoints, whose
requests it generates as chat and completions would."""
from __future__ import annotations

import json

import httpx
import pytest

from services.tokenizer.model_tokenizer import ModelTokenizer
from tests.services.gateway.mesh import WHOLE_POOL_TOKENS
from tests.services.gateway.test_openai_api import MESSAGES, PROMPT, transformers_greedy


@pytest.fixture(scope="module")
def tokenizer(tiny_demo_model) -> ModelTokenizer:
    return ModelTokenizer.from_dir(tiny_demo_model)


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer.encode(PROMPT)


def generate(mesh, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{mesh.gateway.base_url}/inference/v1/generate", json=body, timeout=60, **kwargs)


def events(mesh, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{mesh.gateway.base_url}/inference/v1/generate", json={**body, "stream": True},
                      timeout=60) as answer:
        assert answer.status_code == 200
        lines = [line.removeprefix("data: ") for line in answer.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_token_ids_in_give_transformers_token_ids_out_whole_and_streamed(mesh, client, prompt):
    expected = transformers_greedy(mesh.model_dir, prompt, 8)
    sampling = {"max_tokens": 8, "temperature": 0, "logprobs": 2, "detokenize": False}  # vLLM's own, ignored
    answer = generate(mesh, {"token_ids": prompt, "sampling_params": sampling, "request_id": "rollout-7",
                             "kv_transfer_params": {"do_remote_decode": False}})
    assert answer.status_code == 200 and answer.headers["x-request-id"] == "generate-tokens-rollout-7"
    body = answer.json()
    [choice] = body["choices"]
    assert choice["token_ids"] == expected and choice["index"] == 0 and choice["finish_reason"] in ("length", "stop")
    assert (body["request_id"], body["kv_transfer_params"]) == ("generate-tokens-rollout-7", None)
    assert body["usage"]["prompt_tokens"] == len(prompt) and body["usage"]["completion_tokens"] == len(expected)
    # Logprobs name tokens by id, as the completions API's do when asked to, with the same values.
    content = choice["logprobs"]["content"]
    completion = client.completions.create(model=mesh.model_name, prompt=prompt, max_tokens=8, temperature=0,
                                           logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    assert [entry["token"] for entry in content] == [f"token_id:{t}" for t in expected]
    assert [entry["token"] for entry in content] == completion.choices[0].logprobs.tokens
    assert [entry["logprob"] for entry in content] == pytest.approx(completion.choices[0].logprobs.token_logprobs)
    assert all(len(entry["top_logprobs"]) == 2 for entry in content)

    chunks = events(mesh, {"token_ids": prompt, "sampling_params": sampling,
                           "stream_options": {"include_usage": True}})
    *deltas, usage = chunks
    assert [t for chunk in deltas for t in chunk["choices"][0]["token_ids"]] == expected
    assert [e["token"] for chunk in deltas for e in chunk["choices"][0]["logprobs"]["content"]] == \
        [entry["token"] for entry in content]
    assert deltas[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # (its prompt's cached tokens differ: more now)
    assert usage["choices"] == [] and [usage["usage"][n] for n in counts] == [body["usage"][n] for n in counts]
    assert all(chunk["request_id"].startswith("generate-tokens-") for chunk in chunks)
    mesh.assert_decode_pools_free()


def test_n_seeded_choices_are_the_completions_apis_and_max_tokens_fills_the_context(mesh, client, prompt):
    sampling = {"n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    body = generate(mesh, {"token_ids": prompt, "sampling_params": sampling, "model": mesh.model_name}).json()
    completion = client.completions.create(model=mesh.model_name, prompt=prompt, max_tokens=6, temperature=1.0,
                                           seed=11, n=2, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["token_ids"] for c in body["choices"]] == [c.model_extra["token_ids"] for c in completion.choices]
    assert body["choices"][0]["logprobs"] is None and body["usage"]["completion_tokens"] == 12
    # Without max_tokens a reply may use what the context leaves: three tokens after this prompt.
    long_prompt = (prompt * WHOLE_POOL_TOKENS)[:WHOLE_POOL_TOKENS - 2]
    filled = generate(mesh, {"token_ids": long_prompt, "sampling_params": {"ignore_eos": True}}).json()
    assert len(filled["choices"][0]["token_ids"]) == 3 and filled["choices"][0]["finish_reason"] == "length"
    mesh.assert_decode_pools_free()


def test_abort_requests_ends_a_running_request_and_frees_its_pages(mesh, prompt):
    body = {"token_ids": prompt, "request_id": "to-abort", "stream": True,
            "sampling_params": {"max_tokens": 1500, "ignore_eos": True}}
    with httpx.stream("POST", f"{mesh.gateway.base_url}/inference/v1/generate", json=body, timeout=60) as answer:
        lines = answer.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: ")).removeprefix("data: "))
        assert first["request_id"] == "generate-tokens-to-abort"
        aborted = httpx.post(f"{mesh.gateway.base_url}/abort_requests", timeout=10,
                             json={"request_ids": ["generate-tokens-to-abort", "no-such-request"]})
        assert aborted.json() == {"status": "cancelled", "cancelled_request_ids": ["generate-tokens-to-abort"]}
        rest = [json.loads(line.removeprefix("data: ")) for line in lines
                if line.startswith("data: ") and line != "data: [DONE]"]
    made = len(first["choices"][0]["token_ids"]) + sum(len(c["choices"][0]["token_ids"]) for c in rest)
    assert rest[-1]["choices"][0]["finish_reason"] == "abort" and made < 1500
    mesh.assert_decode_pools_free()


@pytest.mark.parametrize("body, status, param", [
    ({"sampling_params": {"max_tokens": 2}}, 400, "token_ids"),
    ({"token_ids": []}, 400, "token_ids"),
    ({"token_ids": [1, 2], "sampling_params": {"temperature": -1}}, 400, "sampling_params.temperature"),
    ({"token_ids": [1, 2], "sampling_params": {"max_tokens": 0}}, 400, "sampling_params.max_tokens"),
    ({"token_ids": [1, 2], "sampling_params": {"logits_processors": ["x"]}}, 400, "sampling_params.logits_processors"),
    ({"token_ids": [1, 2], "features": {"mm_hashes": {}}}, 400, "features"),
    ({"token_ids": [1, 2], "model": "no-such-model"}, 404, "model"),
    ({"token_ids": [1, 10**6]}, 400, None),
    ({"token_ids": [1] * (WHOLE_POOL_TOKENS + 1)}, 400, None),
])
def test_bad_requests_get_openai_errors_and_leave_no_page(mesh, body, status, param):
    answer = generate(mesh, body)
    error = answer.json()["error"]
    assert answer.status_code == status and error["message"], error
    if param is not None:
        assert error["param"] == param, error
    mesh.assert_decode_pools_free()


def post(mesh, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{mesh.gateway.base_url}{path}", json=body, timeout=60)


def test_a_rendered_chat_request_generates_what_chat_does(mesh, client, tokenizer):
    """vLLM's render: the chat request as the tokens API's, its prompt rendered and encoded as chat's,
    max_tokens what the context leaves, a structured output as its guide; generated, the same tokens."""
    asked = {"model": mesh.model_name, "messages": MESSAGES, "temperature": 0, "logprobs": True, "top_logprobs": 1,
             "extra_body": {"guided_choice": ["red green blue", "cyan magenta"]}}
    rendered = post(mesh, "/v1/chat/completions/render", {k: v for k, v in asked.items() if k != "extra_body"}
                    | asked["extra_body"]).json()
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)[1]
    assert rendered["token_ids"] == prompt and rendered["model"] == mesh.model_name
    sampling = rendered["sampling_params"]
    assert sampling["max_tokens"] == WHOLE_POOL_TOKENS + 1 - len(prompt) and sampling["logprobs"] == 1
    assert sampling["temperature"] == 0 and "regex" in sampling["structured_outputs"]
    generated = generate(mesh, rendered).json()["choices"][0]
    chat = client.chat.completions.create(**{**asked, "extra_body": {**asked["extra_body"], "return_token_ids": True}})
    assert generated["token_ids"] == chat.choices[0].model_extra["token_ids"]
    assert tokenizer.decode(generated["token_ids"]) == chat.choices[0].message.content
    mesh.assert_decode_pools_free()


def test_rendered_completions_are_one_request_per_prompt(mesh, client, tokenizer, prompt):
    asked = {"model": mesh.model_name, "prompt": [PROMPT, "Hello there"], "temperature": 0, "max_tokens": 5,
             "stop": ["zzz"]}
    rendered = post(mesh, "/v1/completions/render", asked).json()
    assert [r["token_ids"] for r in rendered] == [prompt, tokenizer.encode("Hello there")]
    assert all(r["sampling_params"]["max_tokens"] == 5 and r["sampling_params"]["stop"] == ["zzz"] for r in rendered)
    completion = client.completions.create(**asked, extra_body={"return_token_ids": True})
    assert [generate(mesh, r).json()["choices"][0]["token_ids"] for r in rendered] == \
        [c.model_extra["token_ids"] for c in completion.choices]


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/chat/completions/render", {"messages": MESSAGES, "use_beam_search": True, "n": 2}, 400, "use_beam_search"),
    ("/v1/completions/render", {"prompt": "Hi", "max_tokens": 0, "echo": True}, 400, "max_tokens"),
    ("/v1/completions/render", {"prompt": "Hi", "best_of": 2}, 400, "best_of"),
    ("/v1/completions/render", {"prompt": "Hi", "model": "no-such-model"}, 404, "model"),
    ("/v1/completions/render", {"prompt": [1] * WHOLE_POOL_TOKENS, "max_tokens": 5}, 400, "prompt"),
    ("/v1/chat/completions/render", {"messages": MESSAGES, "temperature": -1}, 400, "temperature"),
])
def test_what_the_tokens_api_cannot_carry_is_not_rendered(mesh, path, body, status, param):
    answer = post(mesh, path, {"model": mesh.model_name, **body})
    assert answer.status_code == status and answer.json()["error"]["param"] == param, answer.json()
