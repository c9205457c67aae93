"""SGLang's score API for a generative model and its /generate's token_ids_logprob through the mesh:
the named tokens' logprobs at the next position, checked against transformers' next-token
distribution for the same prompt (Qwen3-Reranker's yes/no way of scoring)."""
from __future__ import annotations

import math

import httpx
import pytest
import torch
from tokenizers import Tokenizer

LABELS = [17, 42, 300]


@pytest.fixture(scope="module")
def next_token_logprobs(mesh):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(mesh.model_dir, dtype=torch.float32)

    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    return logprobs


@pytest.fixture(scope="module")
def tokenizer(mesh) -> Tokenizer:
    return Tokenizer.from_file(str(mesh.model_dir / "tokenizer.json"))


def score(mesh, path: str = "/v1/score", **body) -> httpx.Response:
    return httpx.post(f"{mesh.gateway.base_url}{path}", json={"model": mesh.model_name, **body}, timeout=60)


def test_each_items_label_probabilities_are_the_models_next_token_ones(mesh, next_token_logprobs, tokenizer):
    query, items = "Is the sky blue? Answer:", [" yes", " no it is not"]
    answer = score(mesh, query=query, items=items, label_token_ids=LABELS)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["object"] == "scoring" and body["model"] == mesh.model_name and len(body["scores"]) == 2
    prompts = [tokenizer.encode(query + item).ids for item in items]  # joined as texts, then encoded (BOS too)
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))
    for scores, prompt in zip(body["scores"], prompts):
        expected = next_token_logprobs(prompt)[LABELS].exp().tolist()
        assert scores == pytest.approx(expected, rel=1e-3, abs=1e-7)

    ids = tokenizer.encode(query).ids
    item_ids = [[5, 6, 7], [8]]
    softmaxed = score(mesh, "/score", query=ids, items=item_ids, label_token_ids=LABELS, apply_softmax=True,
                      item_first=True).json()
    for scores, item in zip(softmaxed["scores"], item_ids):
        expected = next_token_logprobs(item + ids)[LABELS].softmax(-1).tolist()
        assert scores == pytest.approx(expected, rel=1e-3, abs=1e-7) and math.isclose(sum(scores), 1, rel_tol=1e-6)
    mesh.assert_decode_pools_free()


def test_vllms_score_api_is_still_served_on_the_same_paths(mesh):
    answer = score(mesh, text_1="a cat", text_2=["a dog", "a hat"])
    assert answer.status_code == 200 and [d["object"] for d in answer.json()["data"]] == ["score", "score"]


@pytest.mark.parametrize(("body", "param"), [
    ({"query": "a", "items": [[5]], "label_token_ids": [1]}, "items"),
    ({"query": "a", "items": ["b"], "label_token_ids": []}, "label_token_ids"),
    ({"query": "a", "items": ["b"], "label_token_ids": [1], "top_k": 3}, "top_k"),
    ({"query": "a", "items": ["b"], "label_token_ids": [10**6]}, "input"),  # outside the vocabulary
])
def test_bad_score_requests_are_400s(mesh, body, param):
    answer = score(mesh, **body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    mesh.assert_decode_pools_free()


def test_generate_gives_the_named_tokens_logprobs_at_each_output_and_prompt_position(mesh, next_token_logprobs):
    prompt = [1, 20, 30, 40]
    answer = httpx.post(f"{mesh.gateway.base_url}/generate", timeout=60, json={
        "input_ids": prompt, "return_logprob": True, "token_ids_logprob": LABELS,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}).json()
    meta = answer["meta_info"]
    named = meta["output_token_ids_logprobs"]
    assert len(named) == 3 and [[entry[1] for entry in position] for position in named] == [LABELS] * 3
    so_far = list(prompt)
    for position, token in zip(named, answer["output_ids"]):  # prefill's first token, then decode's
        expected = next_token_logprobs(so_far)[LABELS].tolist()
        assert [entry[0] for entry in position] == pytest.approx(expected, abs=1e-4)
        so_far.append(token)
    with_prompt = httpx.post(f"{mesh.gateway.base_url}/generate", timeout=60, json={
        "input_ids": prompt, "return_logprob": True, "token_ids_logprob": LABELS, "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).json()["meta_info"]["input_token_ids_logprobs"]
    assert with_prompt[0] is None and len(with_prompt) == len(prompt)  # nothing before the first token
    for end, position in enumerate(with_prompt[1:], start=1):  # what the prompt's first `end` tokens predict
        expected = next_token_logprobs(prompt[:end])[LABELS].tolist()
        assert [entry[0] for entry in position] == pytest.approx(expected, abs=1e-4)
    refused = httpx.post(f"{mesh.gateway.base_url}/generate", timeout=60,
                         json={"input_ids": prompt, "token_ids_logprob": LABELS})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "token_ids_logprob"


def test_a_batch_names_one_list_of_ids_for_all_its_prompts_or_one_per_prompt(mesh):
    def named(token_ids_logprob) -> httpx.Response:
        return httpx.post(f"{mesh.gateway.base_url}/generate", timeout=60, json={
            "input_ids": [[1, 20, 30], [1, 40]], "return_logprob": True, "token_ids_logprob": token_ids_logprob,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}})

    def ids_of(answer: dict) -> list[list[int]]:
        return [[entry[1] for entry in position] for position in answer["meta_info"]["output_token_ids_logprobs"]]

    shared, per_prompt = named(LABELS).json(), named([[5], [6, 7]]).json()
    assert [ids_of(answer) for answer in shared] == [[LABELS] * 2] * 2
    assert [ids_of(answer) for answer in per_prompt] == [[[5]] * 2, [[6, 7]] * 2]
    refused = named([[5]])
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "token_ids_logprob"
