"""SGLang's native API on the gateway (services/gateway/sglang_api.py): `/generate` answers as
SGLang's server does, with the tokens the OpenAI API makes for the same request; streamed, each
event carries the text so far; its errors name SGLang's fields; `/get_model_info` and
`/health_generate`."""
from __future__ import annotations

import json
import re
import threading
import time

import httpx
import openai
import pytest

from services.gateway.sglang_api import ABORTED
from tests.services.gateway.mesh import answer_aborted_while_paused
from tests.unit.test_grammar_guides import DATE_GRAMMARS

PROMPT = "Once upon a time there was"


def generate(mesh, body: dict) -> httpx.Response:
    return httpx.post(f"{mesh.gateway.base_url}/generate", json=body, timeout=60)


def completion(mesh, **fields) -> dict:
    answer = httpx.post(f"{mesh.gateway.base_url}/v1/completions", timeout=60,
                        json={"model": mesh.model_name, "return_tokens_as_token_ids": True, **fields})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_generate_makes_the_completions_apis_tokens_in_sglangs_shape(mesh):
    answer = generate(mesh, {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                                  "ignore_eos": True}, "rid": "sg-1"})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    expected = completion(mesh, prompt=PROMPT, max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)["choices"][0]
    assert body["text"] == expected["text"]
    assert body["output_ids"] == [int(t.removeprefix("token_id:")) for t in expected["logprobs"]["tokens"]]
    meta = body["meta_info"]
    assert meta["id"] == "sg-1" and meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["completion_tokens"] == 12 and meta["prompt_tokens"] > 0 and meta["e2e_latency"] > 0
    assert "output_token_logprobs" not in meta
    mesh.assert_decode_pools_free()


def test_a_batch_of_token_id_prompts_with_n_samples_is_a_list_in_order(mesh):
    prompts = [[5, 6, 7, 8], [40, 41, 42]]
    sampling = {"max_new_tokens": 6, "temperature": 0.9, "sampling_seed": 11, "n": 2, "ignore_eos": True}
    answer = generate(mesh, {"input_ids": prompts, "sampling_params": sampling, "rid": ["a", "b"]})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert [item["index"] for item in body] == [0, 1, 2, 3]
    assert [item["meta_info"]["id"] for item in body] == ["a-0", "a-1", "b-0", "b-1"]
    for p, prompt in enumerate(prompts):  # the completions API seeds choice j with seed + j, as /generate does
        expected = completion(mesh, prompt=prompt, max_tokens=6, temperature=0.9, seed=11, n=2, ignore_eos=True,
                              logprobs=0)
        for j, choice in enumerate(sorted(expected["choices"], key=lambda c: c["index"])):
            assert body[2 * p + j]["output_ids"] == [int(t.removeprefix("token_id:"))
                                                     for t in choice["logprobs"]["tokens"]]


def test_a_list_of_one_prompt_is_answered_by_a_list_and_put_is_taken_as_post(mesh):
    body = {"text": [PROMPT], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    answer = httpx.put(f"{mesh.gateway.base_url}/generate", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    [only] = answer.json()
    assert only["index"] == 0 and only["text"] == generate(mesh, {**body, "text": PROMPT}).json()["text"]


def test_a_stream_sends_the_text_so_far_in_each_event(mesh):
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True},
            "stream": True, "stream_options": {"include_usage": True}, "return_logprob": False,
            "logprob_start_len": -1, "lora_path": None}  # what sglang.bench_serving sends
    events = []
    with httpx.stream("POST", f"{mesh.gateway.base_url}/generate", json=body, timeout=60) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
        for line in answer.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    whole = generate(mesh, {**body, "stream": False}).json()
    assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    for before, after in zip(chunks, chunks[1:]):
        assert after["text"].startswith(before["text"])
        assert after["meta_info"]["completion_tokens"] > before["meta_info"]["completion_tokens"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    assert all(chunk["meta_info"]["finish_reason"] is None for chunk in chunks[:-1])


def test_logprobs_of_the_output_and_of_the_prompt_from_logprob_start_len(mesh):
    prompt = [5, 9, 17, 33, 64]
    answer = generate(mesh, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 5, "temperature": 0,
                                                                       "ignore_eos": True},
                             "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 1,
                             "return_text_in_logprobs": True})
    assert answer.status_code == 200, answer.text
    meta = answer.json()["meta_info"]
    expected = completion(mesh, prompt=prompt, max_tokens=5, temperature=0, ignore_eos=True, logprobs=2,
                          prompt_logprobs=2)
    logprobs = expected["choices"][0]["logprobs"]
    assert [entry[1] for entry in meta["output_token_logprobs"]] == answer.json()["output_ids"]
    assert [entry[0] for entry in meta["output_token_logprobs"]] == pytest.approx(logprobs["token_logprobs"],
                                                                                 abs=1e-5)
    assert all(len(top) == 2 and all(isinstance(e[2], str) for e in top) for top in meta["output_top_logprobs"])
    assert [entry[1] for entry in meta["input_token_logprobs"]] == prompt[1:]  # from position 1 on
    records = expected["choices"][0]["prompt_logprobs"]
    wanted = [record[str(token)]["logprob"] for record, token in zip(records[1:], prompt[1:])]
    assert [entry[0] for entry in meta["input_token_logprobs"]] == pytest.approx(wanted, abs=1e-5)
    # max_new_tokens 0, as SGLang's clients score a text: the prompt's alone.
    scored = generate(mesh, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                             "logprob_start_len": 1})
    assert scored.status_code == 200, scored.text
    assert scored.json()["output_ids"] == [] and scored.json()["text"] == ""
    scored_meta = scored.json()["meta_info"]
    assert scored_meta["finish_reason"] == {"type": "length", "length": 0} and scored_meta["completion_tokens"] == 0
    assert [entry[1] for entry in scored_meta["input_token_logprobs"]] == prompt[1:]
    assert [entry[0] for entry in scored_meta["input_token_logprobs"]] == pytest.approx(wanted, abs=1e-5)
    assert scored_meta["output_token_logprobs"] == []


def test_a_stop_string_ends_the_text_and_is_named_as_matched(mesh):
    sampling = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    text = generate(mesh, {"text": PROMPT, "sampling_params": sampling}).json()["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip()
    stopped = generate(mesh, {"text": PROMPT, "sampling_params": {**sampling, "stop": [stop]}}).json()
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stopped["text"] == text[:text.index(stop)]
    kept = generate(mesh, {"text": PROMPT, "sampling_params": {**sampling, "stop": stop, "no_stop_trim": True}})
    assert kept.json()["text"] == text[:text.index(stop) + len(stop)]


def test_a_stop_regex_ends_the_text_before_its_first_match_and_is_named_as_matched(mesh):
    sampling = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    text = generate(mesh, {"text": PROMPT, "sampling_params": sampling}).json()["text"]
    middle = text[len(text) // 2:len(text) // 2 + 2]
    pattern = re.escape(middle) + "."  # fixed length: the first match to complete is the first in the text
    start = re.search(pattern, text).start()
    stopped = generate(mesh, {"text": PROMPT, "sampling_params": {**sampling, "stop_regex": [pattern]}}).json()
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert stopped["text"] == text[:start]
    kept = generate(mesh, {"text": PROMPT, "sampling_params": {**sampling, "stop_regex": pattern,
                                                                "no_stop_trim": True}}).json()
    assert kept["text"] == text[:start + 3]
    # The OpenAI API takes it too, with SGLang's other extras (its names for vLLM's guided_regex and
    # include_stop_str_in_output), as SGLang's OpenAI server does.
    choice = completion(mesh, prompt=PROMPT, max_tokens=16, temperature=0, ignore_eos=True, stop_regex=pattern,
                        no_stop_trim=True)["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (text[:start + 3], "stop", pattern)
    chat = httpx.post(f"{mesh.gateway.base_url}/v1/chat/completions", timeout=60, json={
        "model": mesh.model_name, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
        "regex": "(yes|no)"}).json()
    assert chat["choices"][0]["message"]["content"] in ("yes", "no")
    mesh.assert_decode_pools_free()


def test_the_sglang_frontends_request_is_served_with_its_defaults(mesh):
    """`sgl.gen` through RuntimeEndpoint sends every sampling parameter it has, unset ones as their defaults."""
    frontend = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 12,
                "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": [], "temperature": 0,
                "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                "ignore_eos": True, "regex": None, "json_schema": None}
    answer = generate(mesh, {"text": PROMPT, "sampling_params": frontend, "return_logprob": False,
                             "logprob_start_len": -1, "top_logprobs_num": 0, "return_text_in_logprobs": False})
    assert answer.status_code == 200, answer.text
    plain = generate(mesh, {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                                "ignore_eos": True}}).json()
    assert answer.json()["text"] == plain["text"]
    # sglang.bench_serving's, and a PD router's fields at the values that ask nothing
    bench = generate(mesh, {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                                "ignore_eos": True},
                            "stream": False, "lora_path": None, "return_logprob": False, "return_routed_experts": False,
                            "logprob_start_len": -1, "image_data": [], "bootstrap_host": None,
                            "return_hidden_states": False})
    assert bench.status_code == 200, bench.text
    assert bench.json()["text"] == plain["text"]


@pytest.mark.parametrize(("body", "param"), [
    ({"text": PROMPT, "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ({"text": PROMPT, "sampling_params": {"max_new_tokens": 0, "min_new_tokens": 1}}, "sampling_params.max_new_tokens"),
    ({"text": PROMPT, "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"text": PROMPT, "sampling_params": {"structural_tag": "{"}}, "sampling_params.structural_tag"),
    ({"text": PROMPT, "sampling_params": {"ebnf": "root ::= 'a' value"}}, "sampling_params.ebnf"),
    ({"text": PROMPT, "sampling_params": {"spaces_between_special_tokens": False}},
     "sampling_params.spaces_between_special_tokens"),
    ({"text": PROMPT, "sampling_params": {"stream_interval": 0}}, "sampling_params.stream_interval"),
    ({"text": PROMPT, "sampling_params": {"stop_regex": "("}}, "sampling_params.stop_regex"),
    ({"text": PROMPT, "sampling_params": {"stop_regex": ["x", "a*"]}}, "sampling_params.stop_regex"),
    ({"text": PROMPT, "sampling_params": {"stream_interval": "4"}}, "sampling_params.stream_interval"),
    ({"text": PROMPT, "input_ids": [1, 2]}, "text"),
    ({"text": PROMPT, "return_hidden_states": True}, "return_hidden_states"),
    ({"text": PROMPT, "return_routed_experts": 0}, "return_routed_experts"),
    ({"text": PROMPT, "image_data": "cat.png"}, "image_data"),
    ({"text": [PROMPT, PROMPT], "rid": "one"}, "rid"),
    ({"input_ids": [5] * 5000, "sampling_params": {"max_new_tokens": 4}}, "input_ids"),
    ({"input_ids": [[5], []], "sampling_params": {"max_new_tokens": 4}}, "input_ids"),  # one empty prompt of two
    ({"text": PROMPT, "lora_path": "no-such-adapter"}, "model"),
])
def test_bad_requests_are_400s_naming_sglangs_field(mesh, body, param):
    answer = generate(mesh, body)
    assert answer.status_code in (400, 404), answer.text
    assert answer.json()["error"]["param"] == param, answer.text
    mesh.assert_decode_pools_free()


def test_ebnf_guides_the_text_as_the_regex_of_its_language(mesh):
    date = r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]"
    texts = [generate(mesh, {"text": PROMPT, "sampling_params": {"max_new_tokens": 30, "temperature": 1.0,
                                                                 "sampling_seed": 3, **guide}}).json()["text"]
             for guide in ({"regex": date}, {"ebnf": DATE_GRAMMARS["gbnf"]})]
    assert texts[0] == texts[1] and re.fullmatch(date, texts[0])


def test_model_info_and_the_generating_health_check(mesh):
    info = httpx.get(f"{mesh.gateway.base_url}/get_model_info", timeout=10).json()
    assert info == {"model_path": mesh.model_name, "tokenizer_path": mesh.model_name, "is_generation": True,
                    "weight_version": "default"}
    assert httpx.get(f"{mesh.gateway.base_url}/health_generate", timeout=60).status_code == 200


def test_abort_request_ends_a_sample_with_its_text_so_far(mesh):
    body = {"text": PROMPT, "rid": "to-abort", "stream": True,
            "sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}}
    chunks = []
    with httpx.stream("POST", f"{mesh.gateway.base_url}/generate", json=body, timeout=60) as answer:
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks.append(json.loads(line.removeprefix("data: ")))
            if len(chunks) == 3:
                aborted = httpx.post(f"{mesh.gateway.base_url}/abort_request", json={"rid": "to-abort"}, timeout=10)
                assert aborted.status_code == 200
    last = chunks[-1]["meta_info"]
    assert last["finish_reason"] == {"type": "abort", "message": "aborted by /abort_request"}
    assert 3 <= last["completion_tokens"] < 1500
    mesh.assert_decode_pools_free()


def test_abort_request_ends_a_chat_still_being_prefilled_at_once(mesh):
    """The prefill workers paused (SIGSTOP), a chat's first token cannot come: /abort_request by its
    x-request-id ends it anyway, at once and with no text, and once the workers go on no page stays
    held and they serve."""
    client = openai.OpenAI(base_url=f"{mesh.gateway.base_url}/v1", api_key="unused", max_retries=0)
    aborted = answer_aborted_while_paused(mesh.prefill, lambda: client.chat.completions.create(
        model=mesh.model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
        extra_headers={"x-request-id": "prefilling"}), mesh.gateway.base_url, "prefilling")
    choice = aborted.choices[0]
    assert choice.finish_reason == "abort" and not choice.message.content, aborted
    assert aborted.usage.completion_tokens == 0
    mesh.assert_decode_pools_free()
    served = generate(mesh, {"text": PROMPT, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}})
    assert served.status_code == 200 and served.json()["meta_info"]["completion_tokens"] == 8, served.text


@pytest.mark.parametrize("named_by", ["header", "rid"])  # x-request-id, or SGLang's rid in the body
def test_abort_request_ends_an_openai_chat_by_its_request_id(mesh, named_by):
    client = openai.OpenAI(base_url=f"{mesh.gateway.base_url}/v1", api_key="unused", max_retries=0)
    headers, body = ({"x-request-id": "chat-7"}, {}) if named_by == "header" else ({}, {"rid": "chat-7"})
    stream = client.chat.completions.create(model=mesh.model_name, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=1500, stream=True, temperature=0,
                                            extra_body={"ignore_eos": True, **body}, extra_headers=headers)
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 3:
            aborted = httpx.post(f"{mesh.gateway.base_url}/abort_request", json={"rid": "chat-7"}, timeout=10)
            assert aborted.status_code == 200
    assert chunks[-1].id == "chat-7" and chunks[-1].choices[0].finish_reason == "abort"
    assert 3 <= sum(bool(c.choices[0].delta.content) for c in chunks) < 1500
    mesh.assert_decode_pools_free()


def test_abort_all_ends_every_running_sample_of_a_batch(mesh):
    answers = {}

    def run():
        answers["batch"] = generate(mesh, {"input_ids": [[5, 6, 7], [8, 9, 10]], "rid": ["x", "y"],
                                           "sampling_params": {"max_new_tokens": 1900, "temperature": 0,
                                                               "ignore_eos": True}})
    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.5)  # both samples running: 1900 tokens each take seconds through the mesh
    assert httpx.post(f"{mesh.gateway.base_url}/abort_request", json={"abort_all": True}, timeout=10).status_code == 200
    thread.join(30)
    body = answers["batch"].json()
    assert [item["meta_info"]["finish_reason"] for item in body] == [ABORTED, ABORTED], body
    assert all(0 < item["meta_info"]["completion_tokens"] < 1900 for item in body)
    mesh.assert_decode_pools_free()


def test_abort_request_by_rid_ends_each_of_its_samples(mesh):
    answers = {}

    def run():
        answers["samples"] = generate(mesh, {"input_ids": [5, 6, 7], "rid": "sampled",
                                             "sampling_params": {"n": 2, "max_new_tokens": 1900, "temperature": 1.0,
                                                                 "ignore_eos": True}})
    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.5)
    assert httpx.post(f"{mesh.gateway.base_url}/abort_request", json={"rid": "sampled"}, timeout=10).status_code == 200
    thread.join(30)
    body = answers["samples"].json()
    assert [(item["meta_info"]["id"], item["meta_info"]["finish_reason"]) for item in body] == \
        [("sampled-0", ABORTED), ("sampled-1", ABORTED)], body
    mesh.assert_decode_pools_free()
