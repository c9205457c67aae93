"""Speculative decoding on the decode workers (--speculative-config, vLLM's), n-gram drafts, a draft
model's and an EAGLE head's: a request streams the same tokens as plain decoding would make, whether its
prompt was prefilled on a prefill worker (the drafts start from the handed-over KV; a draft model computes
the prompt itself; an EAGLE head's first drafts come from the prefill worker, which alone has the prompt's last
hidden state, so each step drafts and takes as one engine doing both would) or on its decode worker; several
tokens may come in one chunk. With
--per-request-spec-decode-metrics, each reply's `metrics.speculative_decoding` tells its own drafts,
and they add up to the worker's counters."""
from __future__ import annotations

import json
import shutil
import socket

import httpx
import openai
import pytest

from engine.config import EngineConfig
from engine.demo_model import make_demo_model
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.speculative import SpeculativeConfig
from tests.draft_models import (
    eagle_replica,
    first_layers_copy,
    qwen3_next_mtp_replica,
    with_mtp_layer,
    with_nemotron_h_mtp_layer,
)
from tests.services.gateway.mesh import start_mesh, stop_mesh

MAX_TOKENS = 48


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
def test_drafted_streams_equal_plain_decoding_on_both_prefill_paths(tiny_demo_model, tmp_path, method):
    if method == "ngram":
        speculative = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    elif method == "draft_model":
        speculative = {"model": str(first_layers_copy(tiny_demo_model, tmp_path / "draft", 1)),
                       "num_speculative_tokens": 3}
    else:  # a head that computes its target (most of its drafts right: no trained head lies here)
        tiny_demo_model, head = eagle_replica(tiny_demo_model, tmp_path / "target", tmp_path / "head")
        speculative = {"method": "eagle", "model": str(head), "num_speculative_tokens": 3}
    short, long = [5, 6, 7, 8] * 5, [40 + (i * 7) % 60 for i in range(300)]  # prefilled on decode; on prefill
    seeded = dict(temperature=0.9, top_p=0.95, seed=7)
    engine = LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=128))
    expected = {}
    for prompt in (short, long):
        for name, sampling in (("greedy", {"temperature": 0.0}), ("seeded", seeded)):
            [done] = [out for out in engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True,
                                                                              **sampling)) if out.finished]
            expected[len(prompt), name] = done.token_ids
    one_engines_steps = {}  # the long prompt's (drafted, accepted) a step, with an EAGLE head
    if method == "eagle":
        drafting = LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=128,
                                          speculative=SpeculativeConfig.from_dict(speculative),
                                          per_request_spec_decode_metrics="detailed"))
        for name, sampling in (("greedy", {"temperature": 0.0}), ("seeded", seeded)):
            [done] = [out for out in drafting.generate([long], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True,
                                                                              **sampling)) if out.finished]
            one_engines_steps[name] = done.spec_decode.per_step
    metrics_port = _free_port()
    decode_args = ("--speculative-config", json.dumps(speculative), "--metrics-port", str(metrics_port),
                   "--per-request-spec-decode-metrics", "detailed")
    # An EAGLE head's KV is in every page: the prefill worker computes it into the prompts' pages it hands over.
    prefill_args = ("--speculative-config", json.dumps(speculative)) if method == "eagle" else ()
    mesh = start_mesh(tiny_demo_model, num_prefill=1, num_decode=1, decode_args=decode_args, prefill_args=prefill_args,
                      gateway_args=("--per-request-spec-decode-metrics", "detailed"))
    try:
        total_chunks = 0
        before = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text  # after its warm-up
        replies = []  # each request's metrics.speculative_decoding
        with openai.OpenAI(base_url=f"{mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
            for (length, name), tokens in expected.items():
                prompt = short if length == len(short) else long
                sampling = {"temperature": 0.0} if name == "greedy" else seeded
                stream = client.completions.create(
                    model=mesh.model_name, prompt=prompt, max_tokens=MAX_TOKENS, stream=True, logprobs=0,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, **sampling})
                made, usage, num_chunks = [], None, 0
                for chunk in stream:
                    if chunk.usage is not None:
                        usage = chunk.usage
                        replies.append(chunk.model_extra["metrics"]["speculative_decoding"])
                    if chunk.choices and chunk.choices[0].logprobs is not None:
                        made += [int(t.removeprefix("token_id:")) for t in chunk.choices[0].logprobs.tokens]
                        num_chunks += 1
                assert made == tokens, (length, name)
                assert usage.completion_tokens == MAX_TOKENS
                if one_engines_steps and prompt is long:
                    assert list(zip(replies[-1]["per_step_drafted"], replies[-1]["per_step_accepted"])) \
                        == one_engines_steps[name]
                total_chunks += num_chunks
        assert total_chunks < MAX_TOKENS * len(expected)  # some steps made several tokens
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        accepted = _counter(metrics, "baton_spec_decode_num_accepted_tokens_total")
        assert accepted > 0 and _counter(metrics, "baton_spec_decode_num_drafts_total") > 0
        assert _counter(metrics, "baton_spec_decode_num_accepted_tokens_per_pos_total") == accepted
        assert 'position="0"' in metrics

        def made_here(name: str) -> float:
            return _counter(metrics, name) - _counter(before, name)

        assert sum(r["num_spec_steps"] for r in replies) == made_here("baton_spec_decode_num_drafts_total")
        assert sum(r["num_draft_tokens"] for r in replies) == made_here("baton_spec_decode_num_draft_tokens_total")
        assert sum(r["num_accepted_draft_tokens"] for r in replies) \
            == made_here("baton_spec_decode_num_accepted_tokens_total") > 0
        k = speculative["num_speculative_tokens"]
        for r in replies:
            assert r["num_spec_tokens"] == k and len(r["acceptance_histogram"]) == k + 1
            assert sum(r["acceptance_histogram"]) == r["num_spec_steps"] == len(r["per_step_accepted"])
            assert sum(r["per_step_accepted"]) == r["num_accepted_draft_tokens"]
            assert sum(r["per_step_drafted"]) == r["num_draft_tokens"]
            if r["num_spec_steps"]:
                assert r["mean_acceptance_length"] == pytest.approx(
                    1 + r["num_accepted_draft_tokens"] / r["num_spec_steps"])
        states = httpx.get(f"{mesh.gateway.base_url}/get_server_info", timeout=10).json()["internal_states"]
        [decode] = [s for s in states if s["kind"] == "decode"]
        drafts = _counter(metrics, "baton_spec_decode_num_drafts_total")
        assert decode["avg_spec_accept_length"] == pytest.approx(1 + accepted / drafts)  # SGLang's figure
        assert decode["speculative_algorithm"] == {"ngram": "NGRAM", "draft_model": "STANDALONE",
                                                   "eagle": "EAGLE"}[method]
        mesh.assert_decode_pools_free()
    finally:
        assert all(code == 0 for code in stop_mesh(mesh).values())


@pytest.mark.parametrize("kind", ["deepseek-v3", "qwen3.5", "nemotron-h-moe"])
def test_a_checkpoints_mtp_layer_drafts_on_the_decode_workers(tmp_path, kind):
    """`{"method": "mtp"}` on decode workers serving DeepSeek-V3 (latent attention and experts, in the MTP layer
    too), Qwen3.5 or Nemotron 3 (their recurrent states handed over beside the pages, the layer's KV in them):
    streams equal plain decoding whether the prompt was prefilled on the decode worker (the layer's context its own)
    or on a prefill worker (from the decode worker's first token); the layer drafts (random weights are seldom
    right; Qwen3.5's layer is made to agree with its model often)."""
    from tests.parity.conftest import make_tiny_model

    if kind == "deepseek-v3":
        model = with_mtp_layer(make_tiny_model(tmp_path / "tiny", kind), tmp_path / "mtp")
    elif kind == "nemotron-h-moe":
        model = with_nemotron_h_mtp_layer(make_tiny_model(tmp_path / "tiny", kind), tmp_path / "mtp")
    else:
        model = qwen3_next_mtp_replica(make_tiny_model(tmp_path / "tiny", kind), tmp_path / "mtp", layer_scale=0.01)
    tokenizer = make_demo_model(tmp_path / "tokenizer", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                vocab_size=512)  # its tokenizer: 512 tokens, as the model's vocabulary
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, model / name)
    short, long = [5, 6, 7, 8] * 5, [40 + (i * 7) % 60 for i in range(300)]  # prefilled on decode; on prefill
    engine = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=128))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
    expected = {len(p): [out for out in engine.generate([p], params) if out.finished][0].token_ids
                for p in (short, long)}
    metrics_port = _free_port()
    speculative = ("--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 2}))
    mesh = start_mesh(model, num_prefill=1, num_decode=1, prefill_args=speculative, decode_args=(
        *speculative, "--metrics-port", str(metrics_port), "--kv-blocks", "64"))  # pages for a context of 1024
    try:
        with openai.OpenAI(base_url=f"{mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
            for prompt in (short, long):
                made = []
                for chunk in client.completions.create(
                        model=mesh.model_name, prompt=prompt, max_tokens=MAX_TOKENS, stream=True, logprobs=0,
                        temperature=0.0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}):
                    if chunk.choices and chunk.choices[0].logprobs is not None:
                        made += [int(t.removeprefix("token_id:")) for t in chunk.choices[0].logprobs.tokens]
                assert made == expected[len(prompt)], len(prompt)
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        assert _counter(metrics, "baton_spec_decode_num_draft_tokens_total") > 0
        if kind == "qwen3.5":
            assert _counter(metrics, "baton_spec_decode_num_accepted_tokens_total") > 0
        # A reservation adds a hybrid model's pages of the request's recurrent states (the MTP layer's in each).
        drafted = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=64, speculative=SpeculativeConfig.from_dict(
            json.loads(speculative[1]))))
        mesh.assert_decode_pools_free(num_tokens=1023 - 16 * drafted.block_manager.num_state_blocks)
    finally:
        assert all(code == 0 for code in stop_mesh(mesh).values())


def _counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
