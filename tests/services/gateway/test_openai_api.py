"""The OpenAI API end to end: the real `openai` client against the gateway in front of a
tokenizer, 2 prefill and 2 decode processes. Greedy output must equal `transformers`,
`baton generate` and an in-process engine on the same model."""
from __future__ import annotations

import asyncio
import datetime
import email.utils
import importlib.metadata
import json
import re
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch

from services.gateway.openai_protocol import INLINE_BAD_WORDS, bad_words_encoded, encoded_bad_words
from services.tokenizer.model_tokenizer import ModelTokenizer
from tests.services.gateway.mesh import gateway_client
from tests.services.service_process import REPO_ROOT
from tests.unit.test_grammar_guides import DATE_GRAMMARS, NESTED, is_nested_prefix

PROMPT = "The quick brown fox jumps over the lazy dog, and then"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def tokenizer(tiny_demo_model) -> ModelTokenizer:
    return ModelTokenizer.from_dir(tiny_demo_model)


def continuation(tokenizer: ModelTokenizer, prompt: list[int], output: list[int]) -> str:
    """The text `output` adds after `prompt`, as the gateway's detokenizer produces it."""
    return tokenizer.decode(prompt + output)[len(tokenizer.decode(prompt)):]


def transformers_greedy(model_dir, prompt: list[int], max_new_tokens: int, **generate_kwargs) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        # An explicit mask: generate would otherwise take the bos token (id 0 = pad here) for padding.
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0, **generate_kwargs)
    ids = out[0, len(prompt):].tolist()
    eos = set(model.generation_config.eos_token_id or [])
    for i, token in enumerate(ids):  # generate stops at eos; keep the eos token, as the engine counts it
        if token in eos:
            return ids[: i + 1]
    return ids


def test_models_lists_the_served_model(client, mesh):
    models = client.models.list()
    assert [m.id for m in models.data] == [mesh.model_name]
    assert client.models.retrieve(mesh.model_name).id == mesh.model_name
    version = httpx.get(f"{mesh.gateway.base_url}/version", timeout=10).json()
    assert version == {"version": importlib.metadata.version("baton")}


def test_responses_carry_a_date_that_goes_on(mesh):
    """uvicorn's Date header, which its ticks renew once a second (the gateway runs those ticks itself)."""
    def date() -> datetime.datetime:
        answer = httpx.get(f"{mesh.gateway.base_url}/health", timeout=10)
        return email.utils.parsedate_to_datetime(answer.headers["date"])

    first = date()
    assert abs((first - datetime.datetime.now(datetime.timezone.utc)).total_seconds()) < 5
    time.sleep(1.2)
    assert date() > first



def test_several_served_names_are_all_answered_and_responses_give_the_first(mesh):
    # vLLM's --served-model-name a b: an alias while clients move from one name to another.
    with gateway_client(mesh, "--served-model-name", "baton-new", "baton-old") as aliased:
        assert [m.id for m in aliased.models.list().data] == ["baton-new", "baton-old"]
        assert aliased.models.retrieve("baton-old").model_extra["root"] == "baton-new"
        for name in ("baton-new", "baton-old"):
            reply = aliased.completions.create(model=name, prompt="Hello", max_tokens=2)
            assert reply.model == "baton-new"
        with pytest.raises(openai.NotFoundError) as unknown:
            aliased.chat.completions.create(model=mesh.model_name, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=1)
        assert "`baton-new` or `baton-old`" in unknown.value.body["message"]

def test_greedy_completion_equals_transformers_and_baton_generate(client, mesh, tokenizer):
    prompt = tokenizer.encode(PROMPT)
    expected_ids = transformers_greedy(mesh.model_dir, prompt, 24)
    response = client.completions.create(model=mesh.model_name, prompt=PROMPT, max_tokens=24, temperature=0)
    choice = response.choices[0]
    assert choice.text == continuation(tokenizer, prompt, expected_ids)
    assert choice.finish_reason == ("length" if len(expected_ids) == 24 else "stop")
    assert response.usage.prompt_tokens == len(prompt)
    assert response.usage.completion_tokens == len(expected_ids)
    assert response.usage.total_tokens == len(prompt) + len(expected_ids)

    cli = subprocess.run([sys.executable, "-m", "cli", "generate", "--model", str(mesh.model_dir),
                          "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "24", "--json"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout.strip().splitlines()[-1])["token_ids"] == expected_ids


def test_streamed_completion_equals_the_whole_one_and_reports_usage(client, mesh, tokenizer):
    whole = client.completions.create(model=mesh.model_name, prompt=PROMPT, max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=mesh.model_name, prompt=PROMPT, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert all(c.usage is None for c in chunks[:-1])


def test_a_gateway_forcing_usage_ends_every_stream_with_it(mesh):
    """vLLM's --enable-force-include-usage: a stream that does not ask for usage ends with it all the same."""
    common = dict(model=mesh.model_name, max_tokens=5, temperature=0, stream=True, extra_body={"ignore_eos": True})
    with gateway_client(mesh, "--enable-force-include-usage") as forcing:
        for chunks in (list(forcing.completions.create(prompt=PROMPT, **common)),
                       list(forcing.chat.completions.create(messages=MESSAGES, **common))):
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
            assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_continuous_usage_stats_give_each_chunk_its_choice_usage_so_far(client, mesh, tokenizer, api):
    """vLLM's `stream_options.continuous_usage_stats`: every chunk's usage counts its choice's tokens so far."""
    common = dict(model=mesh.model_name, max_tokens=12, temperature=0, n=2, stream=True,
                  stream_options={"include_usage": True, "continuous_usage_stats": True},
                  extra_body={"ignore_eos": True})
    if api == "completions":
        chunks = list(client.completions.create(prompt=PROMPT, **common))
        num_prompt = len(tokenizer.encode(PROMPT))
    else:
        chunks = list(client.chat.completions.create(messages=MESSAGES, **common))
        num_prompt = len(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)[1])
    so_far = [0, 0]
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        assert chunk.usage.prompt_tokens == num_prompt
        assert chunk.usage.completion_tokens > so_far[choice.index], chunk  # every chunk brings a token here
        so_far[choice.index] = chunk.usage.completion_tokens
        assert chunk.usage.total_tokens == num_prompt + so_far[choice.index]
    assert so_far == [12, 12]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_a_long_list_of_bad_words_is_encoded_off_the_event_loop(tokenizer, monkeypatch):
    """100,000 bad words held the gateway's event loop (every stream on it) for 1.1 s: past INLINE_BAD_WORDS
    they are encoded on a worker thread, to the same ids."""
    words = [f"w{i}x" for i in range(INLINE_BAD_WORDS + 1)]
    loop_thread = threading.get_ident()
    encoding_threads = set()
    encode_many = tokenizer.encode_many

    def recorded(*args, **kwargs):
        encoding_threads.add(threading.get_ident())
        return encode_many(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode_many", recorded)
    assert asyncio.run(bad_words_encoded(words[:INLINE_BAD_WORDS], tokenizer)) == \
        encoded_bad_words(words[:INLINE_BAD_WORDS], tokenizer)
    assert encoding_threads == {loop_thread}
    encoding_threads.clear()
    assert asyncio.run(bad_words_encoded(words, tokenizer)) == encoded_bad_words(words, tokenizer)
    assert loop_thread in encoding_threads and len(encoding_threads) == 2  # the thread's, then the check's here


def test_bad_words_are_not_written_as_transformers_bans_them(client, mesh, tokenizer):
    """vLLM's bad_words: each word's tokens (alone, and after a space) are banned; against transformers'
    bad_words_ids on words of one token, the first token (banned on the prefill worker) and a later one (on
    the decode worker). Longer words (banned only after the rest of them) are the sampler's unit tests."""
    prompt = tokenizer.encode("Once upon a time")  # its first greedy token is a word (" fun") on this model
    plain = transformers_greedy(mesh.model_dir, prompt, 12)

    def one_token_word(token_id: int) -> str | None:
        word = tokenizer.decode([token_id]).strip()
        encoded = encoded_bad_words([word], tokenizer) if word else []
        return word if all(len(ids) == 1 for ids in encoded) and [token_id] in encoded else None

    first = one_token_word(plain[0])
    later = next(word for token_id in plain[2:] if (word := one_token_word(token_id)) not in (None, first))
    assert first is not None
    for words in ([later], [first, later]):
        banned = encoded_bad_words(words, tokenizer)
        expected = transformers_greedy(mesh.model_dir, prompt, 12, bad_words_ids=banned)
        assert expected != plain
        for stream in (False, True):
            out = client.completions.create(model=mesh.model_name, prompt=prompt, max_tokens=12, temperature=0,
                                            stream=stream, extra_body={"bad_words": words})
            text = "".join(c.choices[0].text for c in out) if stream else out.choices[0].text
            assert text == continuation(tokenizer, prompt, expected), words
    mesh.assert_decode_pools_free()


def test_bad_words_are_encoded_alone_and_after_a_space_as_vllm_encodes_them(tokenizer):
    alone, spaced = (tokenizer.encode(text, add_special_tokens=False) for text in ("fun", " fun"))
    assert len(alone) == len(spaced) and alone[0] != spaced[0]  # on this vocabulary
    assert encoded_bad_words(["fun", "  fun"], tokenizer) == [alone, spaced, alone, spaced]  # leading spaces dropped

    class DropsEverything:  # a normalizer that leaves nothing of a word: it can never be written
        def encode_many(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
            return [[] for _ in texts]
    assert encoded_bad_words(["\u200b"], DropsEverything()) == []


def test_return_tokens_as_token_ids_names_each_logprob_token_by_its_id(client, mesh, tokenizer):
    """vLLM's `return_tokens_as_token_ids`: "token_id:N" for every token in the logprobs (the sampled ones and
    the alternatives), completions and chat, the same ids the text is made of."""
    prompt = tokenizer.encode(PROMPT)
    expected = transformers_greedy(mesh.model_dir, prompt, 6)
    as_ids = client.completions.create(model=mesh.model_name, prompt=prompt, max_tokens=6, temperature=0, logprobs=2,
                                       extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    assert as_ids.tokens == [f"token_id:{t}" for t in expected]
    assert all(len(top) == 2 and all(re.fullmatch(r"token_id:\d+", k) for k in top) for top in as_ids.top_logprobs)
    chat = client.chat.completions.create(model=mesh.model_name, messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=1,
                                          extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs.content
    assert all(re.fullmatch(r"token_id:\d+", e.token) and e.bytes == list(e.token.encode()) for e in chat)
    assert all(re.fullmatch(r"token_id:\d+", e.top_logprobs[0].token) for e in chat)


def test_return_token_ids_gives_the_prompts_and_each_choices_ids_whole_and_streamed(client, mesh, tokenizer):
    """vLLM's `return_token_ids`: a completion choice's `prompt_token_ids` and `token_ids`, a chat response's
    `prompt_token_ids` and its choice's `token_ids`; streamed, the prompt's in the first chunk and each chunk's
    own tokens. Not asked for, none of them."""
    asked = {"return_token_ids": True}
    prompt = tokenizer.encode(PROMPT)
    expected = transformers_greedy(mesh.model_dir, prompt, 8)
    whole = client.completions.create(model=mesh.model_name, prompt=PROMPT, max_tokens=8, temperature=0,
                                      extra_body=asked).choices[0].model_extra
    assert (whole["prompt_token_ids"], whole["token_ids"]) == (prompt, expected)
    chunks = [c.choices[0].model_extra for c in client.completions.create(
        model=mesh.model_name, prompt=PROMPT, max_tokens=8, temperature=0, stream=True, extra_body=asked)]
    assert chunks[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == expected

    chat_prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)[1]
    chat_expected = transformers_greedy(mesh.model_dir, chat_prompt, 6)
    chat = client.chat.completions.create(model=mesh.model_name, messages=MESSAGES, max_tokens=6, temperature=0,
                                          extra_body=asked)
    assert (chat.model_extra["prompt_token_ids"], chat.choices[0].model_extra["token_ids"]) == \
        (chat_prompt, chat_expected)
    chat_chunks = list(client.chat.completions.create(model=mesh.model_name, messages=MESSAGES, max_tokens=6,
                                                      temperature=0, stream=True, extra_body=asked))
    assert chat_chunks[0].model_extra["prompt_token_ids"] == chat_prompt
    assert all("prompt_token_ids" not in c.model_extra for c in chat_chunks[1:])
    assert [t for c in chat_chunks for t in c.choices[0].model_extra["token_ids"]] == chat_expected

    plain = client.completions.create(model=mesh.model_name, prompt=PROMPT, max_tokens=2, temperature=0)
    assert not {"prompt_token_ids", "token_ids"} & plain.choices[0].model_extra.keys()


@pytest.mark.parametrize("length", [40, 3000])  # encoded in the gateway, and by the tokenizer service
def test_add_special_tokens_false_encodes_a_text_prompt_without_its_bos(client, mesh, tokenizer, length):
    """vLLM's completions `add_special_tokens`: false for a text that has its BOS already (a chat template
    the client rendered): the prompt is the text's own tokens, no second BOS."""
    text = tokenizer.decode(tokenizer.encode("x")[:1], skip_special_tokens=False) + ("word " * length)[:length]
    with_bos = tokenizer.encode(text)
    without = tokenizer.encode(text, add_special_tokens=False)
    assert len(with_bos) == len(without) + 1
    common = dict(model=mesh.model_name, prompt=text, max_tokens=3, temperature=0)
    asked = client.completions.create(**common, extra_body={"add_special_tokens": False})
    assert asked.usage.prompt_tokens == len(without)
    assert asked.choices[0].text == client.completions.create(
        **{**common, "prompt": without}).choices[0].text
    assert client.completions.create(**common).usage.prompt_tokens == len(with_bos)


def test_chat_echo_starts_the_reply_with_the_assistant_message_it_continues(client, mesh):
    """vLLM's chat `echo`: a reply that continues a prefilled assistant message starts with it, whole
    and streamed; a reply to any other message starts with nothing more."""
    prefilled = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    common = dict(model=mesh.model_name, max_tokens=6, temperature=0)
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    plain = client.chat.completions.create(messages=prefilled, extra_body=continued, **common)
    echoed = client.chat.completions.create(messages=prefilled, extra_body={**continued, "echo": True}, **common)
    assert echoed.choices[0].message.content == "The answer is" + plain.choices[0].message.content
    # The same tokens (the echo is not generated); cached_tokens depends on which prefill worker each went to.
    assert (echoed.usage.prompt_tokens, echoed.usage.completion_tokens) == (plain.usage.prompt_tokens,
                                                                            plain.usage.completion_tokens)
    streamed = client.chat.completions.create(messages=prefilled, extra_body={**continued, "echo": True}, stream=True,
                                              n=2, **common)
    texts = ["", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [echoed.choices[0].message.content] * 2
    to_user = client.chat.completions.create(messages=MESSAGES, extra_body={"echo": True}, **common)
    assert to_user.choices[0].message.content == client.chat.completions.create(
        messages=MESSAGES, **common).choices[0].message.content


def test_chat_whole_and_streamed_use_the_chat_template(client, mesh, tokenizer):
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)[1]
    expected = continuation(tokenizer, prompt, transformers_greedy(mesh.model_dir, prompt, 16))
    whole = client.chat.completions.create(model=mesh.model_name, messages=MESSAGES, max_completion_tokens=16,
                                           temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected
    assert whole.usage.prompt_tokens == len(prompt)
    stream = client.chat.completions.create(model=mesh.model_name, messages=MESSAGES, max_tokens=16, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_best_of_answers_the_candidates_likeliest_per_token(client, mesh):
    """OpenAI's best_of: best_of candidates per prompt (a seeded request's candidate j samples with seed + j,
    as n choices do), the n with the highest mean logprob kept, best first; every candidate's tokens are
    usage. The candidates, asked for as n choices with their logprobs, say which those are."""
    asked = dict(model=mesh.model_name, prompt=[PROMPT, "Once upon a time"], max_tokens=8, temperature=1.5,
                 seed=7, extra_body={"ignore_eos": True})
    candidates = client.completions.create(n=4, logprobs=0, **asked)
    ranked = {p: sorted((c for c in candidates.choices[4 * p:4 * p + 4]),
                        key=lambda c: sum(c.logprobs.token_logprobs) / 8, reverse=True) for p in (0, 1)}
    assert len({c.text for c in candidates.choices}) > 4  # sampled apart: the ranking has something to rank
    best = client.completions.create(n=2, best_of=4, **asked)
    assert [c.text for c in best.choices] == [c.text for p in (0, 1) for c in ranked[p][:2]]
    assert [c.index for c in best.choices] == [0, 1, 2, 3] and all(c.logprobs is None for c in best.choices)
    assert best.usage.completion_tokens == 2 * 4 * 8  # all eight candidates were generated
    for given, param in (({"n": 2, "best_of": 1}, "best_of"), ({"best_of": 2, "stream": True}, "best_of"),
                         ({"best_of": 129}, "best_of")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(**{**asked, **given})
        assert refused.value.body["param"] == param


def test_stop_strings_end_the_text_before_them(client, mesh):
    free = client.completions.create(model=mesh.model_name, prompt=PROMPT, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = free[10:13]
    assert stop and stop not in free[:12]
    for stops in (stop, [stop, "\x00never"]):
        for stream in (False, True):
            kwargs = dict(model=mesh.model_name, prompt=PROMPT, max_tokens=40, temperature=0, stop=stops,
                          extra_body={"ignore_eos": True})
            if stream:
                chunks = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
                text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
            else:
                choice = client.completions.create(**kwargs).choices[0]
                text, reason = choice.text, choice.finish_reason
            assert (text, reason) == (free[: free.index(stop)], "stop")
    mesh.assert_decode_pools_free()


def test_a_seed_repeats_its_sample_and_n_choices_differ(client, mesh):
    kwargs = dict(model=mesh.model_name, prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.95, seed=1234,
                  extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1})
    first = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == first
    assert client.completions.create(**{**kwargs, "seed": 99}).choices[0].text != first
    # A negative seed, as vLLM takes one (a signed 64-bit integer): the seed of its unsigned bits.
    assert client.completions.create(**{**kwargs, "seed": -1}).choices[0].text == \
        client.completions.create(**{**kwargs, "seed": 2**64 - 1}).choices[0].text != first
    several = client.completions.create(n=3, **kwargs)
    assert [c.index for c in several.choices] == [0, 1, 2]
    assert several.choices[0].text == first
    assert len({c.text for c in several.choices}) == 3
    assert several.usage.completion_tokens == 48
    # An RL rollout's group: more choices than the 16 this API once stopped at, the first the same.
    group = client.completions.create(**{**kwargs, "max_tokens": 2}, n=40)
    assert [c.index for c in group.choices] == list(range(40)) and group.usage.completion_tokens == 80
    assert group.choices[0].text == client.completions.create(**{**kwargs, "max_tokens": 2}).choices[0].text
    mesh.assert_decode_pools_free()


def test_logprobs_for_every_token(client, mesh):
    response = client.completions.create(model=mesh.model_name, prompt=PROMPT, max_tokens=6, temperature=0,
                                         logprobs=3, extra_body={"ignore_eos": True})
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) <= 3 and logprob <= 0
        assert max(top.values()) == pytest.approx(logprob, abs=1e-5)  # greedy takes the best
    chat = client.chat.completions.create(model=mesh.model_name, messages=MESSAGES, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(entry.top_logprobs) == 2 for entry in content)


def test_logit_bias_forces_a_token_on_prefill_and_decode_alike(client, mesh, tokenizer):
    ids = tokenizer.encode(PROMPT)
    expected = continuation(tokenizer, ids, [300] * 4)  # the first token is prefill's, the rest decode's
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 5}):
        forced = client.completions.create(model=mesh.model_name, prompt=ids, max_tokens=4, logit_bias={"300": 100},
                                           extra_body={"ignore_eos": True}, **sampling)
        assert forced.choices[0].text == expected, sampling
    chat = client.chat.completions.create(model=mesh.model_name, messages=MESSAGES, max_tokens=3, temperature=0,
                                          logit_bias={"300": 100}, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == tokenizer.decode([300] * 3)


def test_the_token_that_stops_the_text_counts_but_is_not_in_it(client, mesh, tokenizer):
    # As vLLM: a stop token id (or EOS) ends the text without its own text, unless
    # include_stop_str_in_output; it is counted either way. Token 300 is forced, and stops at once.
    ids = tokenizer.encode(PROMPT)
    forced = dict(model=mesh.model_name, prompt=ids, max_tokens=8, temperature=0, logit_bias={"300": 100})
    for stream in (False, True):
        for kept in (False, True):
            extra = {"ignore_eos": True, "stop_token_ids": [300], "include_stop_str_in_output": kept}
            if stream:
                chunks = [c for c in client.completions.create(stream=True, stream_options={"include_usage": True},
                                                               extra_body=extra, **forced)]
                text, usage = "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage
            else:
                whole = client.completions.create(extra_body=extra, **forced)
                text, usage = whole.choices[0].text, whole.usage
            assert usage.completion_tokens == 1
            assert text == (continuation(tokenizer, ids, [300]) if kept else "")
    assert continuation(tokenizer, ids, [300])
    mesh.assert_decode_pools_free()


def test_min_tokens_holds_off_stop_token_ids_and_stop_strings_on_prefill_and_decode(client, mesh, tokenizer):
    # Token 300 is forced at every step (the first is prefill's, the rest decode's) and stops the text,
    # except where min_tokens bans it: the 3 tokens before it are each the best of the rest.
    ids = tokenizer.encode(PROMPT)
    forced = dict(model=mesh.model_name, prompt=ids, max_tokens=8, temperature=0, logit_bias={"300": 100})
    at_once = client.completions.create(**forced, extra_body={"ignore_eos": True, "stop_token_ids": [300]})
    assert (at_once.usage.completion_tokens, at_once.choices[0].finish_reason) == (1, "stop")
    held = client.completions.create(**forced, extra_body={"ignore_eos": True, "stop_token_ids": [300],
                                                           "min_tokens": 3})
    assert (held.usage.completion_tokens, held.choices[0].finish_reason) == (4, "stop")
    # A stop string: looked for only after the first 3 tokens' text.
    text = continuation(tokenizer, ids, [300] * 4)
    first_three = continuation(tokenizer, ids, [300] * 3)
    stop = text[len(first_three):]
    assert stop and stop in first_three
    for stream in (False, True):
        kwargs = dict(**forced, stop=stop, extra_body={"ignore_eos": True, "min_tokens": 3})
        if stream:
            chunks = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
            got = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            choice = client.completions.create(**kwargs).choices[0]
            got = choice.text, choice.finish_reason
        assert got == (first_three, "stop")
    mesh.assert_decode_pools_free()


def transformers_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    """Row p: the log-softmaxed logits after prompt[:p + 1], which score prompt[p + 1]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(client, mesh, tokenizer):
    # What evaluation harnesses send to score a text: echo, logprobs, one token.
    ids = tokenizer.encode(PROMPT)
    ref = transformers_prompt_logprobs(mesh.model_dir, ids)
    kwargs = dict(model=mesh.model_name, prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=2)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
    streamed_text = "".join(c.choices[0].text for c in chunks)
    streamed_logprobs = {key: sum((getattr(c.choices[0].logprobs, key) for c in chunks), [])
                         for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert chunks[0].choices[0].text.startswith(PROMPT)  # the prompt comes first, in the first chunk
    for text, logprobs in ((whole.text, whole.logprobs.model_dump()), (streamed_text, streamed_logprobs)):
        assert text.startswith(PROMPT) and len(text) > len(PROMPT)
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(ids) + 1
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        for position in range(1, len(ids)):
            assert logprobs["token_logprobs"][position] == pytest.approx(ref[position - 1, ids[position]].item(),
                                                                         abs=1e-4)
            assert sorted(logprobs["top_logprobs"][position].values(), reverse=True) == pytest.approx(
                ref[position - 1].topk(2).values.tolist(), abs=1e-4)
        assert logprobs["tokens"][:len(ids)] == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        assert logprobs["text_offset"][len(ids)] == len(PROMPT)  # the generated token's, after the prompt
    # Token ids are echoed as they decode.
    echoed = client.completions.create(**{**kwargs, "prompt": ids, "logprobs": None}).choices[0]
    assert echoed.text.startswith(tokenizer.decode(ids, skip_special_tokens=False)) and echoed.logprobs is None


def test_max_tokens_0_with_echo_gives_the_prompt_alone_with_its_logprobs(client, mesh, tokenizer):
    """vLLM's prompt-only completion, how evaluation harnesses score a text without generating."""
    ids = tokenizer.encode(PROMPT)
    ref = transformers_prompt_logprobs(mesh.model_dir, ids)
    kwargs = dict(model=mesh.model_name, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    [streamed] = [c.choices[0] for c in chunks if c.choices]
    for choice, usage in ((whole.choices[0], whole.usage), (streamed, chunks[-1].usage)):
        assert choice.text == PROMPT and choice.finish_reason == "length"
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), 0)
        logprobs = choice.logprobs
        assert logprobs.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        assert logprobs.token_logprobs[0] is None
        assert logprobs.token_logprobs[1:] == pytest.approx([ref[p - 1, ids[p]].item() for p in range(1, len(ids))],
                                                            abs=1e-4)
    mesh.assert_decode_pools_free()


def test_prompt_logprobs_of_completions_and_chat_match_transformers(client, mesh, tokenizer):
    ids = tokenizer.encode(PROMPT)
    ref = transformers_prompt_logprobs(mesh.model_dir, ids)

    def check(records: list) -> None:
        assert len(records) == len(ids) and records[0] is None
        for position in range(1, len(ids)):
            record = records[position]
            assert record[str(ids[position])]["logprob"] == pytest.approx(ref[position - 1, ids[position]].item(),
                                                                          abs=1e-4)
            best = ref[position - 1].argmax().item()
            assert record[str(best)]["rank"] == 1
            assert record[str(best)]["decoded_token"] == tokenizer.decode([best], skip_special_tokens=False)

    for stream in (False, True):
        response = client.completions.create(model=mesh.model_name, prompt=ids, max_tokens=2, temperature=0,
                                             stream=stream, extra_body={"prompt_logprobs": 1})
        choice = next(iter(response)).choices[0] if stream else response.choices[0]
        check(choice.model_extra["prompt_logprobs"])
    chat_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)[1]
    chat = client.chat.completions.create(model=mesh.model_name, messages=MESSAGES, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 0})
    records = chat.model_extra["prompt_logprobs"]
    assert len(records) == len(chat_ids) and all(len(r) == 1 for r in records[1:])  # the prompt's own tokens
    assert [int(next(iter(r))) for r in records[1:]] == chat_ids[1:]
    mesh.assert_decode_pools_free()


def test_special_tokens_are_left_out_of_the_text_unless_asked_for(client, mesh, tokenizer):
    eos = tokenizer.eos_token_ids[0]  # forced, with EOS ignored: three of them
    kwargs = dict(model=mesh.model_name, prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={str(eos): 100})
    assert client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].text == ""
    kept = client.completions.create(**kwargs, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert kept.choices[0].text == tokenizer.decode([eos] * 3, skip_special_tokens=False) != ""
    chat = client.chat.completions.create(model=mesh.model_name, messages=MESSAGES, max_tokens=2, temperature=0,
                                          logit_bias={str(eos): 100},
                                          extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert chat.choices[0].message.content == tokenizer.decode([eos] * 2, skip_special_tokens=False)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, mesh, tokenizer):
    ids = [(7 * j) % 900 + 5 for j in range(40)]
    kwargs = dict(model=mesh.model_name, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(prompt=ids[-10:], **kwargs)
    cut = client.completions.create(prompt=ids, **{**kwargs, "extra_body": {"ignore_eos": True,
                                                                          "truncate_prompt_tokens": 10}})
    assert cut.usage.prompt_tokens == 10 and cut.choices[0].text == whole.choices[0].text
    # A prompt past the context fits once cut; chat's rendered prompt is cut the same way.
    long = client.completions.create(prompt="word " * 3000, **{**kwargs, "extra_body": {"truncate_prompt_tokens": 100}})
    assert long.usage.prompt_tokens == 100
    chat = client.chat.completions.create(model=mesh.model_name, messages=MESSAGES, max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 3})
    assert chat.usage.prompt_tokens == 3


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0}}, "required": ["name", "age"]}


def test_structured_output_holds_the_text_to_a_schema_a_regex_or_a_choice(client, mesh):
    # Guided on the prefill worker (the first token) and the decode worker (the rest) alike.
    json_schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 11}):
        kwargs = dict(model=mesh.model_name, messages=MESSAGES, max_tokens=80, response_format=json_schema,
                      **sampling)
        whole = client.chat.completions.create(**kwargs).choices[0]
        person = json.loads(whole.message.content)
        assert set(person) == {"name", "age"} and isinstance(person["age"], int) and whole.finish_reason == "stop"
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True,
                                                                                                     **kwargs))
        assert streamed == whole.message.content
    # Any object: this random model may run out of tokens inside a string, never outside JSON.
    anything = client.chat.completions.create(model=mesh.model_name, messages=MESSAGES, max_tokens=120,
                                              temperature=0, response_format={"type": "json_object"}).choices[0]
    assert anything.message.content.startswith("{")
    if anything.finish_reason == "stop":
        assert isinstance(json.loads(anything.message.content), dict)
    date = r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]"
    dated = client.completions.create(model=mesh.model_name, prompt=PROMPT, max_tokens=30, temperature=0,
                                      extra_body={"guided_regex": date, "ignore_eos": True}).choices[0]
    assert re.fullmatch(date, dated.text) and dated.finish_reason == "stop"
    colours = ["red", "green", "light blue"]
    for seed in range(3):
        picked = client.completions.create(model=mesh.model_name, prompt=PROMPT, max_tokens=10, temperature=1.0,
                                           seed=seed, extra_body={"guided_choice": colours}).choices[0].text
        assert picked in colours
    # vLLM's newer `structured_outputs` asks for the same as the guided_* fields it replaces.
    for newer, older in (({"choice": colours}, {"guided_choice": colours}), ({"regex": date}, {"guided_regex": date}),
                         ({"json": PERSON}, {"guided_json": PERSON}), ({"json_object": True},
                                                                       {"response_format": {"type": "json_object"}})):
        texts = [client.completions.create(model=mesh.model_name, prompt=PROMPT, max_tokens=40, temperature=1.0,
                                           seed=3, extra_body=body).choices[0].text
                 for body in ({"structured_outputs": newer}, older)]
        assert texts[0] == texts[1], newer
    mesh.assert_decode_pools_free()


def test_a_regex_too_large_to_index_ahead_is_guided_at_once(client, mesh):
    """`x{100000}`'s whole index took outlines-core minutes to build (`.{0,100000}`'s, tens of GB): guided by
    llguidance as it goes instead (engine/guided_decoding.py), its first tokens come as any request's."""
    reply = client.with_options(timeout=30).completions.create(
        model=mesh.model_name, prompt=PROMPT, max_tokens=6, temperature=0,
        extra_body={"guided_regex": "x{100000}", "ignore_eos": True}).choices[0]
    assert reply.text and set(reply.text) == {"x"} and reply.finish_reason == "length"
    mesh.assert_decode_pools_free()


def test_a_grammar_or_a_structural_tag_holds_the_text(client, mesh):
    date = r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]"
    # A grammar of a regular language guides as its regex does (this vocabulary has no byte-fallback
    # tokens): the same text, GBNF or Lark, the first token sampled on a prefill worker, the rest on decode.
    dates = [client.completions.create(model=mesh.model_name, prompt=PROMPT, max_tokens=30, temperature=1.0, seed=4,
                                       extra_body=body).choices[0]
             for body in ({"guided_regex": date}, {"guided_grammar": DATE_GRAMMARS["gbnf"]},
                          {"structured_outputs": {"grammar": DATE_GRAMMARS["lark"]}})]
    assert len({d.text for d in dates}) == 1 and re.fullmatch(date, dates[0].text), [d.text for d in dates]
    assert {d.finish_reason for d in dates} == {"stop"}
    kwargs = dict(model=mesh.model_name, messages=MESSAGES, max_tokens=40, temperature=1.0, seed=2,
                  extra_body={"guided_grammar": NESTED})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    assert is_nested_prefix(whole)
    assert "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True,
                                                                                             **kwargs)) == whole
    # A structural tag set off by what this model writes first anyway: the text goes on as its structure.
    free = client.completions.create(model=mesh.model_name, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
    begin = free.strip()[:3]
    assert len(begin) == 3 and begin.isascii(), free
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}
    tag = {"type": "structural_tag", "triggers": [begin], "structures": [{"begin": begin, "schema": city,
                                                                          "end": "</call>"}]}
    for body in ({"response_format": tag}, {"structured_outputs": {"structural_tag": json.dumps(tag)}}):
        tagged = client.completions.create(model=mesh.model_name, prompt=PROMPT, max_tokens=40, temperature=0,
                                           extra_body=body).choices[0].text
        before = free[:free.index(begin) + len(begin)]
        arguments, end, _ = tagged.removeprefix(before).partition("</call>")
        assert tagged.startswith(before) and end and set(json.loads(arguments)) == {"city"}, tagged
    mesh.assert_decode_pools_free()


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}},
]


def streamed_tool_calls(client, **kwargs) -> tuple[dict[int, dict], str, int]:
    """The tool calls a stream makes, put together from its deltas, its finish reason, and how many
    chunks before the last carried some of them."""
    calls: dict[int, dict] = {}
    reason, num_early = None, 0
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        assert not choice.delta.content
        for delta in choice.delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = call["id"] or delta.id
            call["name"] = call["name"] or delta.function.name
            call["arguments"] += delta.function.arguments or ""
        num_early += bool(choice.delta.tool_calls) and choice.finish_reason is None
        reason = choice.finish_reason or reason
    return calls, reason, num_early


def test_forced_tool_calls_come_as_tool_calls_whole_and_streamed(client, mesh):
    kwargs = dict(model=mesh.model_name, messages=MESSAGES, max_tokens=80, temperature=0, tools=TOOLS)
    named = client.chat.completions.create(
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kwargs).choices[0]
    assert named.message.content is None and named.finish_reason == "stop"
    [call] = named.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert set(json.loads(call.function.arguments)) == {"city"}
    streamed, reason, _ = streamed_tool_calls(
        client, tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kwargs)
    assert reason == "stop" and [(c["name"], c["arguments"]) for c in streamed.values()] == [
        ("get_weather", call.function.arguments)]

    required_response = client.chat.completions.create(tool_choice="required", **kwargs)
    required = required_response.choices[0]
    assert required.finish_reason == "tool_calls" and required.message.content is None
    made = [(c.function.name, json.loads(c.function.arguments)) for c in required.message.tool_calls]
    assert len(made) > 1 and all(name in ("get_weather", "get_time") for name, _ in made)
    # parallel_tool_calls false: the list is guided to end after its first call (not written on, then cut).
    single = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **kwargs)
    assert single.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in single.choices[0].message.tool_calls] == [
        (required.message.tool_calls[0].function.name, required.message.tool_calls[0].function.arguments)]
    assert single.usage.completion_tokens < required_response.usage.completion_tokens
    # Streamed as they are written, as the model's own calls are: each named, then its arguments.
    streamed, reason, num_early = streamed_tool_calls(client, tool_choice="required", **kwargs)
    assert reason == "tool_calls" and num_early > len(made)
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
        (c.function.name, c.function.arguments) for c in required.message.tool_calls]

    # The conversation goes on with the call and the tool's answer in it; "none" answers in text.
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"}]
    # Greedy and past EOS: sampled, a first token of EOS left no text, and the test failed by chance.
    answer = client.chat.completions.create(model=mesh.model_name, messages=history, max_tokens=4, tools=TOOLS,
                                            tool_choice="none", temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0]
    assert answer.message.content and not answer.message.tool_calls
    with pytest.raises(openai.BadRequestError, match="auto"):
        client.chat.completions.create(model=mesh.model_name, messages=MESSAGES, max_tokens=4, tools=TOOLS)
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "nope"}}, **kwargs)
    mesh.assert_decode_pools_free()


def test_token_id_prompts_and_several_prompts(client, mesh, tokenizer):
    ids = tokenizer.encode(PROMPT)
    by_text = client.completions.create(model=mesh.model_name, prompt=PROMPT, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=mesh.model_name, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model=mesh.model_name, prompt=[PROMPT, "Another prompt"], max_tokens=8,
                                      temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text
    # A batch as evaluation harnesses send one (more prompts than n's limit of 16), each prompt's answer its own.
    large = client.completions.create(model=mesh.model_name, prompt=[PROMPT, "Another prompt"] * 20, max_tokens=8,
                                      temperature=0)
    assert [c.text for c in large.choices] == [c.text for c in batch.choices] * 20
    with pytest.raises(openai.BadRequestError, match="at most 2048 choices"):
        client.completions.create(model=mesh.model_name, prompt=[ids] * 1025, n=2, max_tokens=1)


def test_null_in_openais_nullable_fields_means_their_default(mesh):
    """Clients generated from OpenAI's spec send `"n": null` and the like; vLLM's own extras stay strict."""
    chat = {"model": mesh.model_name, "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    completion = {"model": mesh.model_name, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    nulls = {"n": None, "stream": None, "logprobs": None}
    with httpx.Client(base_url=mesh.gateway.base_url, timeout=60) as http:
        for path, body, own_nulls in (("/v1/chat/completions", chat, {"parallel_tool_calls": None}),
                                      ("/v1/completions", completion, {"echo": None})):
            plain = http.post(path, json=body)
            with_nulls = http.post(path, json=body | nulls | own_nulls)
            assert with_nulls.status_code == 200, with_nulls.text
            assert [c["index"] for c in with_nulls.json()["choices"]] == [0]
            assert with_nulls.json()["choices"][0].get("logprobs") is None
            assert with_nulls.json()["choices"] == plain.json()["choices"]
            refused = http.post(path, json=body | {"ignore_eos": None})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "ignore_eos"


def test_thirty_two_concurrent_streams_complete_with_correct_usage(mesh, tokenizer):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, object]:
        prompt = f"Request number {i} asks about"
        stream = await client.completions.create(
            model=mesh.model_name, prompt=prompt, max_tokens=12 + i % 5, temperature=0.7, seed=i, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = [chunk async for chunk in stream]
        return prompt, chunks

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{mesh.gateway.base_url}/v1", api_key="unused",
                                      max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(main())
    for i, (prompt, chunks) in enumerate(results):
        usage = chunks[-1].usage
        assert usage.completion_tokens == 12 + i % 5
        assert usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    mesh.assert_decode_pools_free()
