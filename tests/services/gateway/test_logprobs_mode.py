"""vLLM's --logprobs-mode on the workers: the logprobs a reply reports are those its tokens were drawn
from (processed_logprobs), on the prefill worker's first token and the decode worker's others alike,
or the logits themselves (raw_logits, a prompt's too, equal to transformers'); and --max-logprobs on
the gateway and the workers: how many top logprobs a request may ask for."""
from __future__ import annotations

import math

import openai
import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from services.common.settings import ConfigError
from services.decode.config import DecodeServiceConfig
from services.gateway.config import GatewayConfig
from services.prefill.config import PrefillServiceConfig
from tests.services.gateway.mesh import running_mesh


@pytest.mark.parametrize("config", [PrefillServiceConfig, DecodeServiceConfig])
def test_the_flag_and_its_variable(tiny_demo_model, config):
    kind = "PREFILL" if config is PrefillServiceConfig else "DECODE"
    model = ["--model", str(tiny_demo_model)]
    assert config.from_args(model, {}).logprobs_mode == "raw_logprobs"
    assert config.from_args([*model, "--logprobs-mode", "processed_logprobs"], {}).logprobs_mode == \
        "processed_logprobs"
    assert config.from_args(model, {f"BATON_{kind}_LOGPROBS_MODE": "raw_logits"}).logprobs_mode == "raw_logits"
    with pytest.raises(ConfigError, match="--logprobs-mode must be one of raw_logprobs, processed_logprobs"):
        config.from_args([*model, "--logprobs-mode", "processed"], {})
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        EngineConfig(model=str(tiny_demo_model), logprobs_mode="logits")
    assert config.from_args(model, {}).max_logprobs == 20
    assert config.from_args([*model, "--max-logprobs", "-1"], {}).max_logprobs == -1
    assert config.from_args(model, {f"BATON_{kind}_MAX_LOGPROBS": "64"}).max_logprobs == 64
    with pytest.raises(ConfigError, match="--max-logprobs must be >= -1"):
        config.from_args([*model, "--max-logprobs", "-2"], {})


def test_the_gateways_max_logprobs(tiny_demo_model):
    common = ["--model", str(tiny_demo_model), "--tokenizer", "127.0.0.1:1", "--prefill", "127.0.0.1:2",
              "--decode", "127.0.0.1:3"]
    assert GatewayConfig.from_args(common, {}).max_logprobs == 20
    assert GatewayConfig.from_args(common, {"BATON_GATEWAY_MAX_LOGPROBS": "100"}).max_logprobs == 100
    with pytest.raises(ConfigError, match="--max-logprobs must be >= -1"):
        GatewayConfig.from_args([*common, "--max-logprobs", "-5"], {})


def test_raw_logits_mode_reports_a_prompts_logits_as_transformers_computes_them(tiny_demo_model):
    from transformers import AutoModelForCausalLM

    prompt = [3, 141, 59, 26, 53, 58]
    engine = LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=16, logprobs_mode="raw_logits"))
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, logprobs=0)
    [out] = [out for out in engine.generate([prompt], params) if out.finished]
    model = AutoModelForCausalLM.from_pretrained(tiny_demo_model, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]  # [P, V]
    for position, record in enumerate(out.prompt_logprobs[1:]):  # position predicts the next token
        target = prompt[position + 1]
        assert record[target] == pytest.approx(logits[position, target].item(), abs=1e-3)
    first = out.token_ids[0]
    assert out.new_logprobs[0][first] == pytest.approx(logits[-1].max().item(), abs=1e-3)


@pytest.fixture(scope="module")
def processed_mesh(tiny_demo_model):
    with running_mesh(tiny_demo_model, num_prefill=1, num_decode=1,
                      gateway_args=("--local-prefill-max-tokens", "0", "--max-logprobs", "50"),
                      worker_args=("--logprobs-mode", "processed_logprobs", "--max-logprobs", "50")) as mesh:
        yield mesh


def test_processed_logprobs_come_from_the_prefill_and_decode_workers_alike(processed_mesh):
    mesh = processed_mesh
    with openai.OpenAI(base_url=f"{mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
        choice = client.completions.create(model=mesh.model_name, prompt="The quick brown fox", max_tokens=5,
                                           temperature=0.8, logprobs=3, seed=7,
                                           extra_body={"top_k": 2, "return_tokens_as_token_ids": True}).choices[0]
    tops = choice.logprobs.top_logprobs
    assert len(tops) == 5
    for top in tops:  # top-2 of the vocabulary: the third likeliest is masked, at vLLM's floor
        values = sorted(top.values(), reverse=True)
        assert values[2] == -9999.0
        assert math.exp(values[0]) + math.exp(values[1]) == pytest.approx(1.0, abs=1e-4)
    mesh.assert_decode_pools_free()


def test_max_logprobs_lets_a_request_ask_for_more_and_refuses_past_it(processed_mesh, tiny_demo_model):
    mesh = processed_mesh
    with openai.OpenAI(base_url=f"{mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
        many = client.completions.create(model=mesh.model_name, prompt="The quick brown fox", max_tokens=3,
                                         temperature=0, logprobs=40, extra_body={"return_tokens_as_token_ids": True,
                                                                                 "prompt_logprobs": 50})
        assert [len(top) for top in many.choices[0].logprobs.top_logprobs] == [40, 40, 40]
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=mesh.model_name, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, logprobs=True, top_logprobs=51)
    assert refused.value.body["param"] == "logprobs" and "--max-logprobs" in refused.value.body["message"]
    engine = LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=16, max_logprobs=-1))
    vocab = engine.model_config.vocab_size
    engine.add_request("whole", [1, 2], SamplingParams(max_tokens=1, logprobs=vocab))
    with pytest.raises(ValueError, match=f"logprobs must be at most {vocab}"):
        engine.add_request("past", [1, 2], SamplingParams(max_tokens=1, logprobs=vocab + 1))
    with pytest.raises(ValueError, match="prompt_logprobs must be at most 20"):
        LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=16)).add_request(
            "r", [1, 2], SamplingParams(prompt_logprobs=21))
    mesh.assert_decode_pools_free()
