"""Gemma 4 (engine/gemma4_config.py, engine/models/gemma4.py) beyond the generic parity tests of its tiny models
(tests/parity/conftest.py's gemma4-e and gemma4-k-eq-v): its pages, its released checkpoint, its KV handed from
a prefill engine to a decode engine, and what is refused."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.model_config_loader import ModelConfigError, load_model_config
from engine.sampling_params import SamplingParams
from tests.parity.conftest import decoded_from_handed_over_pages, greedy_outputs, transformers
from tests.parity.test_transformers_parity import _engine, _prefill_logits, _random_prompt


@pytest.mark.parametrize(("name", "places", "page_heads"), [
    # 6 layers, the last 2 sharing: the full layer's 2 KV heads of 32 span the 4 heads of 16 of a pool layer,
    # each sliding layer's 2 of 16 half of one: the first two sliding layers share a pool layer.
    ("gemma4-e", ((0, 0), (0, 2), (1, 0), (2, 0), (2, 0), (1, 0)), 4),
    ("gemma4-k-eq-v", ((0, 0), (1, 0), (2, 0)), 2),  # 2 sliding KV heads of 16; the full layers' one of 32
])
def test_the_pages_hold_every_layer_computing_kv_in_heads_of_the_narrower_kind(tiny_model_dirs, name, places,
                                                                               page_heads):
    engine = _engine(tiny_model_dirs[name])
    assert engine.model_config.gemma4.kv_places == places
    assert tuple(engine.runner.kv_pool.tensor.shape) == (max(p for p, _ in places) + 1, 2, page_heads,
                                                         engine.num_kv_blocks, engine.config.block_size, 16)
    engine.close()


def _tiny_gemma4_multimodal(seed: int):
    text = transformers.Gemma4TextConfig(
        hidden_size=64, intermediate_size=160, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, global_head_dim=32, vocab_size=512, vocab_size_per_layer_input=512, hidden_size_per_layer_input=8,
        num_kv_shared_layers=2, sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 3,
        final_logit_softcapping=30.0, initializer_range=0.2)
    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    audio = transformers.Gemma4AudioConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    torch.manual_seed(seed)
    return transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=audio.to_dict())).eval()


def test_its_multimodal_checkpoint_serves_its_text_model(tmp_path):
    """Gemma4ForConditionalGeneration as transformers saves it (the full layers' heads in per_layer_config) and as
    Gemma 4 is released (global_head_dim), its image and audio towers left unread."""
    model = _tiny_gemma4_multimodal(seed=4)
    model.save_pretrained(tmp_path / "saved")
    released = shutil.copytree(tmp_path / "saved", tmp_path / "released")
    config = json.loads((released / "config.json").read_text())
    del config["text_config"]["per_layer_config"]
    config["text_config"]["global_head_dim"] = 32
    (released / "config.json").write_text(json.dumps(config))
    for model_dir in (tmp_path / "saved", released):
        engine = _engine(model_dir, max_num_batched_tokens=32, max_model_len=1024)
        assert engine.model_config.architecture == "Gemma4ForCausalLM"
        assert engine.model_config.gemma4.full.head_dim == 32
        for n in (17, 300):
            prompt = _random_prompt(n, engine.model_config.vocab_size, seed=n)
            with torch.no_grad():
                ref = model(input_ids=torch.tensor([prompt])).logits[0, -1]
            assert (_prefill_logits(engine, prompt) - ref).abs().max().item() < 1e-4, (model_dir.name, n)
        engine.close()


@pytest.mark.parametrize("name", ["gemma4-e", "gemma3n"])
def test_a_prompt_prefilled_by_one_engine_decodes_from_its_pages_as_colocated(tiny_model_dirs, name):
    """As a decode worker serves a prefill worker's prompt: the pages copied whole carry every layer computing KV,
    and the layers sharing theirs read them there (Gemma 3n's too)."""
    model_dir = tiny_model_dirs[name]
    prompts = {f"r{n}": _random_prompt(n, 512, seed=n) for n in (5, 40, 130)}
    colocated = _engine(model_dir)
    expected = greedy_outputs(colocated, {rid: (prompt, {}) for rid, prompt in prompts.items()}, max_tokens=24)
    colocated.close()
    prefill, decode = _engine(model_dir, max_num_batched_tokens=32), _engine(model_dir)
    outputs = decoded_from_handed_over_pages(prefill, decode, {rid: (prompt, 24, {}, {})
                                                               for rid, prompt in prompts.items()})
    assert {rid: out.token_ids for rid, out in outputs.items()} == expected
    prefill.close()
    decode.close()


def test_what_it_refuses(tiny_model_dirs, tmp_path):
    model_dir = tiny_model_dirs["gemma4-e"]
    engine = _engine(model_dir)
    with pytest.raises(ValueError, match="per-layer embeddings"):
        engine.add_request("embeds", [5, 6, 7], SamplingParams(max_tokens=4), prompt_embeds=torch.zeros(3, 64))
    engine.close()
    base = json.loads((model_dir / "config.json").read_text())
    for change, reason in (({"enable_moe_block": True, "num_experts": 4}, "needs num_experts, top_k_experts"),
                           ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 5,
                             "moe_intermediate_size": 32}, "top_k_experts 5"),
                           ({"per_layer_config": {"2": {"head_dim": 32, "sliding_window": 8}}}, "sliding_window"),
                           ({"global_head_dim": 24, "per_layer_config": None}, "share pages"),
                           ({"num_kv_shared_layers": 6}, "no layer"),
                           ({"use_bidirectional_attention": "all"}, "causally")):
        bad = tmp_path / reason.replace(" ", "-").replace(",", "")
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**base, **change}))
        with pytest.raises(ModelConfigError, match=reason):
            load_model_config(bad)

