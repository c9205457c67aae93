"""Mistral Small 4's text model (Mistral4ForCausalLM, released inside Mistral3ForConditionalGeneration) against
transformers on the same weights: DeepSeek's latent attention with its YaRN, q scaled by position as Ministral 3's
(llama_4_scaling_beta), experts routed by softmax (renormalized, scaled) beside a shared expert, each layer's experts
fused in two tensors; logits in one chunk and many, greedy tokens with a prefix served from the cache."""
from __future__ import annotations

import json

import pytest
import torch

from tests.parity.conftest import transformers
from tests.parity.test_transformers_parity import _engine, _mixed_prompts, _prefill_logits, _random_prompt

pytestmark = pytest.mark.usefixtures("forked_ranks")  # (tests/parity/conftest.py)

TEXT = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            vocab_size=512, q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=20,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, n_shared_experts=1,
            first_k_dense_replace=1, routed_scaling_factor=1.5, max_position_embeddings=1024, initializer_range=0.2,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "llama_4_scaling_beta": 0.1, "rope_theta": 10000.0})


def _noised(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    model.generation_config.eos_token_id = None
    return model.eval()


@pytest.fixture(scope="module")
def mistral4(tmp_path_factory):
    torch.manual_seed(4)
    model = _noised(transformers.Mistral4ForCausalLM(transformers.Mistral4Config(**TEXT)))
    path = tmp_path_factory.mktemp("mistral4")
    model.save_pretrained(path)
    return path, model


@pytest.mark.parametrize("budget", [512, 32])
def test_logits_are_transformers(mistral4, budget):
    path, model = mistral4
    engine = _engine(path, max_num_batched_tokens=budget)
    for n in (1, 17, 300):  # 300: past YaRN's original context and the q scaling's first step
        prompt = _random_prompt(n, 512, seed=n)
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0, -1]
        assert (_prefill_logits(engine, prompt) - ref).abs().max().item() < 1e-4, n
    engine.close()


def test_greedy_tokens_with_a_cached_prefix_are_transformers(mistral4):
    from tests.parity.conftest import greedy_outputs

    path, model = mistral4
    prompts = _mixed_prompts(512)
    engine = _engine(path, max_num_batched_tokens=64)
    results = greedy_outputs(engine, {f"r{i}": (p, {}) for i, p in enumerate(prompts)}, max_tokens=16)
    engine.close()
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0)
        assert results[f"r{i}"] == out[0, len(prompt):].tolist(), i


def test_mistral3s_multimodal_checkpoint_serves_mistral4_text(tmp_path):
    """As Mistral Small 4 is released: Mistral3ForConditionalGeneration over a Pixtral tower, its text_config
    `mistral4`."""
    vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2, image_size=56, patch_size=14)
    torch.manual_seed(5)
    model = _noised(transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(
        text_config={**TEXT, "model_type": "mistral4"}, vision_config=vision.to_dict())))
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["text_config"]["model_type"] == "mistral4"
    engine = _engine(tmp_path, max_num_batched_tokens=32)
    assert engine.model_config.architecture == "Mistral4ForCausalLM"
    for n in (17, 300):
        prompt = _random_prompt(n, 512, seed=n)
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([prompt])).logits[0, -1]
        assert (_prefill_logits(engine, prompt) - ref).abs().max().item() < 1e-4, n
    engine.close()


def test_split_across_two_ranks_and_what_it_refuses(mistral4, tmp_path):
    """Its heads, experts' widths and vocabulary split in two compute transformers' logits; experts routed within
    groups (n_group > 1) are refused by name."""
    from engine.model_config_loader import ModelConfigError, load_model_config

    path, model = mistral4
    engine = _engine(path, max_num_batched_tokens=32, tensor_parallel_size=2)
    prompt = _random_prompt(40, 512, seed=40)
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0, -1]
    assert (_prefill_logits(engine, prompt) - ref).abs().max().item() < 1e-4
    engine.close()
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_group": 2, "topk_group": 1}))
    with pytest.raises(ModelConfigError, match="n_group 2 is not supported"):
        load_model_config(tmp_path)
