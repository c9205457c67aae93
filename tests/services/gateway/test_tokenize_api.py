"""vLLM's `/tokenize` and `/detokenize` through the gateway (and SGLang's, with its `/v1` paths and
batches): the ids are the ones generation is given for the same prompt or messages (its usage counts
them), the ids decode back to the text, and bad input is a 400 (or 404) naming the field."""
from __future__ import annotations

import re

import httpx
import pytest
from tokenizers import Tokenizer

from services.tokenizer.model_tokenizer import ModelTokenizer
from tests.services.gateway.mesh import GatewayProcess

PROMPT = "The quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def hf_tokenizer(mesh) -> Tokenizer:
    return Tokenizer.from_file(str(mesh.model_dir / "tokenizer.json"))


def post(mesh, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{mesh.gateway.base_url}{path}", json=body, timeout=30)


def tokenized(mesh, **body) -> dict:
    response = post(mesh, "/tokenize", body)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_prompts_ids_are_the_ones_generation_counts(mesh, client, hf_tokenizer):
    answer = tokenized(mesh, model=mesh.model_name, prompt=PROMPT)
    assert answer["tokens"] == hf_tokenizer.encode(PROMPT, add_special_tokens=True).ids
    assert answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == 2048 and answer["token_strs"] is None
    usage = client.completions.create(model=mesh.model_name, prompt=PROMPT, max_tokens=1).usage
    assert usage.prompt_tokens == answer["count"]
    with_strs = tokenized(mesh, prompt=PROMPT, return_token_strs=True)
    assert with_strs["token_strs"] == [hf_tokenizer.id_to_token(t) for t in answer["tokens"]]
    assert "".join(with_strs["token_strs"]) != PROMPT  # the vocabulary's strings, not decoded text
    bare = tokenized(mesh, prompt=PROMPT, add_special_tokens=False)["tokens"]  # no model: this one's
    assert bare == hf_tokenizer.encode(PROMPT, add_special_tokens=False).ids and len(bare) < answer["count"]


def test_messages_are_rendered_as_chat_completions_renders_them(mesh, client, hf_tokenizer):
    answer = tokenized(mesh, model=mesh.model_name, messages=MESSAGES)
    usage = client.chat.completions.create(model=mesh.model_name, messages=MESSAGES, max_tokens=1).usage
    assert usage.prompt_tokens == answer["count"]
    without_generation_prompt = tokenized(mesh, messages=MESSAGES, add_generation_prompt=False)["tokens"]
    assert without_generation_prompt == answer["tokens"][:len(without_generation_prompt)]
    assert len(without_generation_prompt) < answer["count"]
    # As vLLM: the rendered text encoded again, special tokens added (a second BOS where the template has one).
    rendered, ids = ModelTokenizer.from_dir(mesh.model_dir).apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert ids == answer["tokens"]
    doubled = tokenized(mesh, messages=MESSAGES, add_special_tokens=True)["tokens"]
    assert doubled == hf_tokenizer.encode(rendered, add_special_tokens=True).ids


def test_a_continued_assistant_turn_is_rendered_as_transformers_renders_it(mesh, client):
    # The reply continues a prefilled assistant message: by the tokenizer service (/tokenize) and by
    # chat completions (the gateway renders a conversation this short itself), the same ids.
    messages = [*MESSAGES, {"role": "assistant", "content": "Red, green and"}]
    expected = ModelTokenizer.from_dir(mesh.model_dir).apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True)[1]
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(mesh.model_dir).apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True, tokenize=True)
    assert expected == list(hf["input_ids"] if hasattr(hf, "keys") else hf)
    options = {"add_generation_prompt": False, "continue_final_message": True,
               "chat_template_kwargs": {"enable_thinking": False}}  # a variable this template does not read
    assert tokenized(mesh, messages=messages, **options)["tokens"] == expected
    usage = client.chat.completions.create(model=mesh.model_name, messages=messages, max_tokens=1,
                                           extra_body=options).usage
    assert usage.prompt_tokens == len(expected)


def test_ids_detokenize_back_to_the_prompt(mesh):
    ids = tokenized(mesh, prompt=PROMPT, add_special_tokens=False)["tokens"]
    response = post(mesh, "/detokenize", {"model": mesh.model_name, "tokens": ids})
    assert response.status_code == 200, response.text
    assert response.json() == {"prompt": PROMPT, "text": PROMPT}  # vLLM's name for it, and SGLang's


def test_sglangs_batches_and_paths_answer_as_sglang_does(mesh, hf_tokenizer):
    """SGLang serves /v1/tokenize and /v1/detokenize beside vLLM's paths, with a batch of prompts or of
    token lists, and skips special tokens in what it detokenizes unless asked not to."""
    prompts = [PROMPT, "Hello"]
    for path in ("/tokenize", "/v1/tokenize"):
        answer = post(mesh, path, {"prompt": prompts}).json()
        expected = [hf_tokenizer.encode(p, add_special_tokens=True).ids for p in prompts]
        assert answer == {"tokens": expected, "count": [len(ids) for ids in expected], "max_model_len": 2048,
                          "token_strs": None}
    with_bos = post(mesh, "/v1/tokenize", {"prompt": PROMPT}).json()["tokens"]
    assert hf_tokenizer.decode(with_bos[:1], skip_special_tokens=False) != ""  # the demo tokenizer's BOS
    skipped = post(mesh, "/v1/detokenize", {"tokens": with_bos}).json()
    assert skipped == {"prompt": PROMPT, "text": PROMPT}
    kept = post(mesh, "/v1/detokenize", {"tokens": with_bos, "skip_special_tokens": False}).json()["text"]
    assert kept == post(mesh, "/detokenize", {"tokens": with_bos}).json()["text"] != PROMPT
    assert kept.endswith(PROMPT)
    batch = post(mesh, "/v1/detokenize", {"tokens": [with_bos, hf_tokenizer.encode("Hello").ids]}).json()
    assert batch["text"] == [PROMPT, "Hello"]


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, 400, None),
    ("/tokenize", {"model": "x"}, 400, None),
    ("/tokenize", {"messages": []}, 400, None),
    ("/tokenize", {"messages": [{"role": "narrator", "content": "x"}]}, 400, "messages.0.role"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, None),  # and a generation prompt
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"messages": []}}, 400, None),
    ("/tokenize", {"prompt": "x", "model": "nope"}, 404, "model"),
    ("/detokenize", {"tokens": [5, 1024]}, 400, "tokens"),  # the vocabulary is 1024 ids
    ("/detokenize", {"tokens": [5, -1]}, 400, "tokens.1"),
    ("/detokenize", {"tokens": []}, 400, "tokens"),
    ("/detokenize", {"tokens": [5], "model": "nope"}, 404, "model"),
    ("/v1/tokenize", {"prompt": []}, 400, "prompt"),
    ("/v1/detokenize", {"tokens": [[5], []]}, 400, "tokens.1"),
])
def test_bad_input_is_an_openai_error_naming_the_field(mesh, path, body, status, param):
    response = post(mesh, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["param"] == param, error


def test_a_tokenizer_service_that_is_down_is_routed_around(mesh, hf_tokenizer):
    """--tokenizer takes several services, each long prompt going to the least loaded one that serves:
    the first named here never answers (before, every prompt the gateway did not encode went to it)."""
    gateway = GatewayProcess(mesh.model_dir, f"127.0.0.1:1,{mesh.tokenizer.address}",
                             [p.address for p in mesh.prefill], [d.address for d in mesh.decode],
                             "--local-tokenize-max-chars", "0")
    try:
        for _ in range(3):  # taking turns would have sent some to the one that is down
            answer = httpx.post(f"{gateway.base_url}/v1/completions", timeout=30,
                                json={"model": mesh.model_name, "prompt": PROMPT, "max_tokens": 2})
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["prompt_tokens"] == len(hf_tokenizer.encode(PROMPT).ids)
        answer = httpx.post(f"{gateway.base_url}/tokenize", timeout=30, json={"prompt": PROMPT})
        assert answer.status_code == 200 and answer.json()["tokens"] == hf_tokenizer.encode(PROMPT).ids
        workers = httpx.get(f"{gateway.base_url}/metrics", timeout=10).text
        assert re.search(r'baton_gateway_workers\{[^}]*kind="tokenizer"[^}]*state="known"[^}]*\} 2\.0', workers)
        assert re.search(r'baton_gateway_workers\{[^}]*kind="tokenizer"[^}]*state="serving"[^}]*\} 1\.0', workers)
    finally:
        gateway.terminate()
