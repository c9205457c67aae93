"""Beam search (vLLM's `use_beam_search`) through the mesh: the same beams, in the same order and
with the same scores, as `transformers.generate(num_beams=n, early_stopping="never")` on the same
weights; ended by the model's end tokens or stop_token_ids; completions, chat and streams; what it
cannot honour refused; and a client that leaves stops the search."""
from __future__ import annotations

import re
import time
from collections.abc import Callable

import httpx
import pytest
import torch

from services.tokenizer.model_tokenizer import ModelTokenizer
from tests.services.gateway.test_bad_input import _raw_stream_request, assert_openai_error, post

PROMPT = [5, 17, 300, 42, 99, 7, 8, 123]
BEAM_SEARCH = {"use_beam_search": True, "return_tokens_as_token_ids": True}


@pytest.fixture(scope="module")
def hf_model(mesh):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(mesh.model_dir, dtype=torch.float32)


def transformers_beams(model, prompt: list[int], n: int, max_new_tokens: int, end_token_ids: list[int] | None,
                       length_penalty: float = 1.0) -> list[tuple[list[int], float]]:
    """Each returned beam's tokens (its end token kept, padding cut) and its score, best first."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=n, num_return_sequences=n,
                             max_new_tokens=max_new_tokens, do_sample=False, early_stopping="never",
                             length_penalty=length_penalty, eos_token_id=end_token_ids, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
    beams = []
    for sequence, score in zip(out.sequences, out.sequences_scores):
        tokens = sequence[len(prompt):].tolist()
        for i, token in enumerate(tokens):
            if token in (end_token_ids or ()):
                tokens = tokens[:i + 1]
                break
        beams.append((tokens, float(score)))
    return beams


def beams_of(choices, length_penalty: float = 1.0) -> list[tuple[list[int], float]]:
    """Each choice's tokens (read from its logprobs, named by id) and its score, in choice order."""
    beams = []
    for choice in choices:
        tokens = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
        beams.append((tokens, sum(choice.logprobs.token_logprobs) / len(tokens) ** length_penalty))
    return beams


def assert_same_beams(ours, theirs):
    assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in theirs]
    assert [score for _, score in ours] == pytest.approx([score for _, score in theirs], abs=1e-4)


def test_beams_equal_transformers_beam_search(client, mesh, hf_model):
    response = client.completions.create(model=mesh.model_name, prompt=PROMPT, n=3, max_tokens=6, logprobs=1,
                                         extra_body={**BEAM_SEARCH, "ignore_eos": True})
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in response.choices)
    assert_same_beams(beams_of(response.choices), transformers_beams(hf_model, PROMPT, 3, 6, None))
    assert len({tuple(tokens) for tokens, _ in beams_of(response.choices)}) == 3
    assert response.usage.prompt_tokens == len(PROMPT)
    assert response.usage.completion_tokens == 18


@pytest.mark.parametrize("length_penalty", [1.0, 2.0, -0.5])
def test_an_end_token_ends_a_beam_as_in_transformers(client, mesh, hf_model, length_penalty):
    """The third token of the best unended beam ends beams that reach it: their score counts it
    and their text leaves it out; beams that do not stop at max_tokens. A length penalty of 2 favours
    the long ones over them."""
    free = client.completions.create(model=mesh.model_name, prompt=PROMPT, n=3, max_tokens=6, logprobs=1,
                                     extra_body={**BEAM_SEARCH, "ignore_eos": True})
    end = beams_of(free.choices)[0][0][2]
    response = client.completions.create(
        model=mesh.model_name, prompt=PROMPT, n=3, max_tokens=8, logprobs=1,
        extra_body={**BEAM_SEARCH, "ignore_eos": True, "stop_token_ids": [end], "length_penalty": length_penalty})
    ours = beams_of(response.choices, length_penalty)
    assert_same_beams(ours, transformers_beams(hf_model, PROMPT, 3, 8, [end], length_penalty))
    assert any(tokens[-1] == end for tokens, _ in ours) == (length_penalty <= 1.0)
    tokenizer = ModelTokenizer.from_dir(mesh.model_dir)
    for choice, (tokens, _) in zip(response.choices, ours):
        if tokens[-1] == end:
            assert choice.finish_reason == "stop"
            assert choice.text == tokenizer.decode(PROMPT + tokens[:-1])[len(tokenizer.decode(PROMPT)):]
        else:
            assert choice.finish_reason == "length" and len(tokens) == 8


def test_a_stream_sends_each_beam_whole_as_the_whole_response_has_them(client, mesh):
    kwargs = dict(model=mesh.model_name, prompt=PROMPT, n=2, max_tokens=5, extra_body={"use_beam_search": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    texts = {}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {c.index: c.text for c in whole.choices}
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_several_prompts_each_get_their_own_beams(client, mesh):
    other = [9, 8, 7, 6]
    both = client.completions.create(model=mesh.model_name, prompt=[PROMPT, other], n=2, max_tokens=4,
                                     extra_body={"use_beam_search": True})
    alone = [client.completions.create(model=mesh.model_name, prompt=p, n=2, max_tokens=4,
                                       extra_body={"use_beam_search": True}) for p in (PROMPT, other)]
    assert [c.text for c in both.choices] == [c.text for a in alone for c in a.choices]
    assert both.usage.prompt_tokens == len(PROMPT) + len(other)


def test_chat_beams_are_the_rendered_conversations_beams(client, mesh):
    messages = [{"role": "user", "content": "Name three colours."}]
    tokenizer = ModelTokenizer.from_dir(mesh.model_dir)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)[1]
    chat = client.chat.completions.create(model=mesh.model_name, messages=messages, n=2, max_completion_tokens=5,
                                          extra_body={"use_beam_search": True})
    completion = client.completions.create(model=mesh.model_name, prompt=rendered, n=2, max_tokens=5,
                                           extra_body={"use_beam_search": True})
    assert [c.message.content for c in chat.choices] == [c.text for c in completion.choices]
    assert chat.usage.prompt_tokens == len(rendered)


@pytest.mark.parametrize(("extra", "param"), [
    ({"n": 11}, "n"),
    ({"stop": ["x"]}, "stop"),
    ({"presence_penalty": 1.0}, "presence_penalty"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"min_tokens": 2}, "min_tokens"),
    ({"response_format": {"type": "json_object"}}, "use_beam_search"),
])
def test_what_beam_search_cannot_honour_is_a_400_naming_it(mesh, extra, param):
    body = {"model": mesh.model_name, "prompt": "hi", "max_tokens": 4, "use_beam_search": True, **extra}
    assert_openai_error(post(mesh, "/v1/completions", body), 400, param=param)
    mesh.assert_decode_pools_free()


def test_a_prompt_over_the_context_is_a_400(mesh):
    body = {"model": mesh.model_name, "prompt": [5] * 2040, "max_tokens": 16, "n": 2, "use_beam_search": True}
    assert_openai_error(post(mesh, "/v1/completions", body), 400)


def requests_in_progress(mesh) -> float:
    metrics = httpx.get(f"{mesh.gateway.base_url}/metrics", timeout=5).text
    return float(re.search(r"^baton_gateway_requests_in_progress(?:\{[^}]*\})? (\S+)$", metrics, re.M).group(1))


def assert_leaving_stops_the_search(mesh, leave: Callable[[], None]) -> None:
    """Once a search's steps are under way, `leave()` (its client going away) ends them within a
    second, and no step starts after."""
    deadline = time.monotonic() + 5.0
    while not requests_in_progress(mesh):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    leave()
    deadline = time.monotonic() + 1.0
    while requests_in_progress(mesh) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert requests_in_progress(mesh) == 0
    time.sleep(0.3)
    assert requests_in_progress(mesh) == 0  # no step started after it
    mesh.assert_decode_pools_free(within_s=1.0)


def test_a_client_that_leaves_stops_the_search(mesh):
    body = {"model": mesh.model_name, "prompt": "A long story begins", "max_tokens": 1500, "n": 4, "stream": True,
            "ignore_eos": True, "use_beam_search": True}
    sock = _raw_stream_request(mesh, body)  # its status line waits for its first event: the search's end
    assert_leaving_stops_the_search(mesh, sock.close)
