"""Qwen4-Exp's config as Baton reads it and what it refuses of it; where its indexer's keys are kept. Its logits and
greedy tokens against transformers are test_transformers_parity.py's, its states' test_hybrid_models.py's."""
from __future__ import annotations

import json

import pytest
import torch

from engine.kv_pool import kv_block_bytes
from engine.linear_attention_config import FULL, LINEAR
from engine.model_config_loader import ModelConfigError, load_model_config
from engine.models.ngram_embedding import PerLayerNGrams
from engine.sampling_params import SamplingParams
from engine.speculative import SpeculativeConfig
from kernels.registry import select_kernels
from tests.parity.conftest import copied_with_config, greedy_outputs
from tests.parity.test_transformers_parity import (
    _engine,
    _hf_model,
    _prefill_logits,
    _random_prompt,
)


def _with_config(tiny_model_dirs, tmp_path, changes: dict, removed: tuple[str, ...] = ()):
    return copied_with_config(tiny_model_dirs["qwen4-exp"], tmp_path, changes, removed)


def test_its_attention_layers_read_as_transformers_reads_them(tiny_model_dirs, tmp_path):
    """transformers saves its attention layers as `indexed_attention`, its releases name them `full_attention`; without
    layer_types every fourth layer attends."""
    saved_dir = tiny_model_dirs["qwen4-exp"]
    assert json.loads((saved_dir / "config.json").read_text())["layer_types"][1] == "indexed_attention"
    saved = load_model_config(saved_dir).linear_attention
    assert saved.layer_types == (LINEAR, FULL) * 2
    released = _with_config(tiny_model_dirs, tmp_path / "released", {"layer_types": ["linear_attention",
                                                                                      "full_attention"] * 2})
    assert load_model_config(released).linear_attention == saved
    defaults = _with_config(tiny_model_dirs, tmp_path / "defaults", {"num_hidden_layers": 8}, ("layer_types",))
    assert load_model_config(defaults).linear_attention.kv_places == {3: 0, 7: 1}


def test_its_pages_keep_each_tokens_indexer_key_as_one_more_head(tiny_model_dirs):
    """2 KV heads and the indexer's key a token in each attention layer's pages, so a cached prefix and a handed-over
    prompt carry it (test_hybrid_models.py checks both against transformers)."""
    engine = _engine(tiny_model_dirs["qwen4-exp"])
    config = engine.model_config
    assert (config.num_kv_heads, config.page_kv_heads) == (2, 3)
    assert engine.runner.kv_pool.tensor.shape[2] == 3
    assert kv_block_bytes(config, 16, engine.runner.kv_pool.tensor.dtype) == 2 * 2 * 3 * 16 * 16 * 4
    engine.add_request("r", _random_prompt(40, 512, seed=40), SamplingParams(max_tokens=2), prefill_only=True)
    next(out for step in iter(engine.step, None) for out in step if out.finished)
    blocks = engine.held_block_ids("r")[:3]  # the prompt's (its states' follow)
    pages = engine.runner.kv_pool.tensor[:, :, :, blocks]  # [L, 2, H, 3 pages, bs, D]: no V beside the key
    assert (pages[:, 0, 2].flatten(1, 2)[:, :40] != 0).all() and (pages[:, 1, 2] == 0).all()
    engine.release("r")
    engine.close()


@pytest.mark.parametrize("changes, removed, refused", [
    ({"ple_layer_ids": [2]}, (), "on linear-attention layers only, got layers \\[2\\]"),
    ({"ple_layer_ids": [5]}, (), "count layers from 1 to 4"),
    ({"ple_layer_ids": [1], "ple_embed_dim": 60, "heads_per_ngram": 8}, (), "positive multiple of the n-gram heads"),
    ({"ple_layer_ids": [1], "eos_token_id": None}, (), "need eos_token_id"),
    ({}, ("indexer_budget",), "indexer_budget missing"),
    ({"indexer_kv_heads": 2}, (), "one key head"),
    ({"indexer_budget": 20}, (), "multiple of indexer_compress_ratio"),
    ({"indexer_head_dim": 32}, (), "wider than an attention head"),
    ({"indexer_head_dim": 4}, (), "more than the indexer's head"),
    ({"output_gate_type": "gelu"}, (), "SiLU or a sigmoid"),
    ({"hc_count": 1}, (), "at least two streams"),
])
def test_what_it_cannot_serve_is_refused_by_name(tiny_model_dirs, tmp_path, changes, removed, refused):
    with pytest.raises(ModelConfigError, match=refused):
        load_model_config(_with_config(tiny_model_dirs, tmp_path, changes, removed))


def test_a_prompt_longer_than_its_budget_attends_to_fewer_tokens_than_it_sees(tiny_model_dirs, tmp_path):
    """With a budget past the prompt every query attends to every token before it: the tokens differ."""
    prompt = _random_prompt(300, 512, seed=300)
    tokens = {}
    for name, model_dir in (("sparse", tiny_model_dirs["qwen4-exp"]),
                            ("dense", _with_config(tiny_model_dirs, tmp_path, {"indexer_budget": 512}))):
        engine = _engine(model_dir)
        tokens[name] = greedy_outputs(engine, {"r": (prompt, {})}, 16)["r"]
        engine.close()
    assert tokens["sparse"] != tokens["dense"]


@pytest.mark.parametrize("overrides, refused", [
    (dict(tensor_parallel_size=2), "tensor parallelism does not split .* yet"),
    (dict(speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=1)), "multi-token"),
])
def test_what_it_cannot_do_yet_is_refused_by_name(tiny_model_dirs, overrides, refused):
    with pytest.raises(ValueError, match=refused):
        _engine(tiny_model_dirs["qwen4-exp"], **overrides)


@pytest.mark.parametrize("budget", [512, 7])
def test_n_grams_stop_at_an_eos_token_as_transformers_stops_them(tiny_model_dirs, budget):
    """Prompts with EOS tokens inside (one first, two together, one last) in one chunk and in chunks of 7 (an EOS
    at a chunk's edge): their n-grams read EOS in place of every token at or before one, and the logits and greedy
    tokens are transformers' (pages of 4 tokens, so that chunks of 7 may be asked for)."""
    model_dir = tiny_model_dirs["qwen4-exp-ngrams"]
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    prompts = [_random_prompt(40, 512, seed=i) for i in range(3)]
    prompts[0][0] = prompts[0][13] = prompts[0][14] = prompts[0][-1] = eos
    prompts[1][6] = prompts[1][20] = eos
    prompts[2][-2] = eos
    hf = _hf_model(model_dir)
    engine = _engine(model_dir, max_num_batched_tokens=budget, block_size=4)
    for prompt in prompts:
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0, -1]
        assert (_prefill_logits(engine, prompt) - expected).abs().max().item() < 1e-4
    outputs = greedy_outputs(engine, {f"r{i}": (p, {}) for i, p in enumerate(prompts)}, 12)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            generated = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
        assert outputs[f"r{i}"] == generated[0, len(prompt):].tolist(), i
    engine.close()


def test_a_prompt_given_as_embeddings_is_refused_where_n_grams_need_its_tokens(tiny_model_dirs):
    engine = _engine(tiny_model_dirs["qwen4-exp-ngrams"])
    with pytest.raises(ValueError, match="no tokens to look up Qwen4-Exp's n-gram embeddings"):
        engine.add_request("r", [0] * 4, SamplingParams(max_tokens=2), prompt_embeds=torch.zeros(4, 64))
    engine.close()
    engine = _engine(tiny_model_dirs["qwen4-exp"])  # without them, embeddings serve
    greedy_outputs(engine, {"r": ([0] * 4, {"prompt_embeds": torch.randn(4, 64)})}, 2)
    engine.close()


def test_its_n_gram_tables_stay_in_host_memory_wherever_the_model_is(tiny_model_dirs):
    """Made on any device (here meta, where nothing is allocated), its tables are the host's, and no parameter or
    buffer: moving the model leaves them where they are."""
    config = load_model_config(tiny_model_dirs["qwen4-exp-ngrams"])
    with torch.device("meta"):
        layer = PerLayerNGrams(config, select_kernels("cpu"), torch.float32, 0)
    assert layer.tables.device.type == "cpu" and layer.tables.shape == (408, 16)
    assert all(p.device.type == "meta" for p in layer.parameters())
    assert not any(t is layer.tables for t in (*layer.parameters(), *layer.buffers()))
