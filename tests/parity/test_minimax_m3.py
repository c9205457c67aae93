"""MiniMax-M3's text model: its config as Baton reads it and what it refuses of it; its indexer's keys handed over with
the pages. Its logits and greedy tokens against transformers are test_transformers_parity.py's
(TINY_MODELS["minimax-m3"])."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engine.model_config_loader import ModelConfigError, load_model_config
from tests.parity.conftest import (
    COMMON,
    TINY_MODELS,
    copied_with_config,
    decoded_from_handed_over_pages,
    transformers,
)
from tests.parity.test_transformers_parity import _check_last_logits, _engine, _hf_model, _random_prompt

pytestmark = pytest.mark.usefixtures("forked_ranks")  # (tests/parity/conftest.py)


def _copy(tiny_model_dirs, tmp_path, changes: dict, removed: tuple[str, ...] = ()):
    return copied_with_config(tiny_model_dirs["minimax-m3"], tmp_path, changes, removed)


def test_its_checkpoints_older_names_of_its_layout_read_as_transformers_reads_them(tiny_model_dirs, tmp_path):
    """sparse_attention_config's names of the indexer's settings and its sparse layers, moe_layer_freq's of its
    dense ones."""
    saved = load_model_config(tiny_model_dirs["minimax-m3"])
    older = _copy(tiny_model_dirs, tmp_path, {
        "sparse_attention_config": {"sparse_num_index_heads": 2, "sparse_index_dim": 16, "sparse_block_size": 8,
                                    "sparse_topk_blocks": 3, "sparse_local_block": 1,
                                    "sparse_attention_freq": [0, 1, 0, 1]},
        "moe_layer_freq": [0, 1, 1, 1]}, ("layer_types", "mlp_layer_types", "index_n_heads", "index_head_dim",
                                          "index_block_size", "index_topk_blocks", "index_local_blocks"))
    config = load_model_config(older)
    assert config.minimax_m3 == saved.minimax_m3 and config.minimax_m3.sparse_layers == {1, 3}
    assert config.moe == saved.moe and config.moe.dense_layers == {0}
    assert (config.num_kv_heads, config.page_kv_heads) == (2, 3)


@pytest.mark.parametrize("changes, refused", [
    ({"index_n_heads": 4}, "a head a KV head"),
    ({"index_local_blocks": 4}, "more than index_topk_blocks"),
    ({"index_head_dim": 32}, "fit an attention head"),
    ({"layer_types": ["full_attention", "sliding_attention"] * 2}, "layer_types must name"),
])
def test_what_it_cannot_serve_is_refused_by_name(tiny_model_dirs, tmp_path, changes, refused):
    with pytest.raises(ModelConfigError, match=refused):
        load_model_config(_copy(tiny_model_dirs, tmp_path, changes))


def test_a_decode_engine_continues_from_the_pages_and_indexer_keys_prefill_handed_over(tiny_model_dirs):
    model_dir = tiny_model_dirs["minimax-m3"]
    prefill = _engine(model_dir, block_size=4, max_num_batched_tokens=32)  # the prompts in several chunks
    decode = _engine(model_dir, block_size=4)
    prompts = [_random_prompt(n, 512, seed=n) for n in (1, 45, 130)]
    outputs = decoded_from_handed_over_pages(prefill, decode, {f"r{i}": (p, 10, {}, {}) for i, p in enumerate(prompts)})
    hf = _hf_model(model_dir)
    for i, prompt in enumerate(prompts):  # the first token prefill's, then decode's
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt):].tolist()
        assert outputs[f"r{i}"].token_ids == expected, i
    prefill.close()
    decode.close()


def test_its_checkpoint_as_released_serves_its_text_model_by_minimaxs_names(tmp_path):
    """MiniMax-M3 as released (a MiniMaxM3SparseForConditionalGeneration, as transformers saves it too): its text model
    under `language_model.`, its experts Mixtral's w1/w2/w3 under `block_sparse_moe.`, gate and up apart, the
    indexer's tensors `self_attn.index_*`, its vision tower and projectors beside (its images not served yet)."""
    text = transformers.MiniMaxM3VLTextConfig(**{**COMMON, **TINY_MODELS["minimax-m3"][1]})
    vision = transformers.MiniMaxM3VLVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                  num_attention_heads=2, image_size=56)
    torch.manual_seed(3)
    model = transformers.MiniMaxM3SparseForConditionalGeneration(transformers.MiniMaxM3VLConfig(
        text_config=text.to_dict(), vision_config=vision.to_dict())).eval()
    with torch.no_grad():  # its norms' weights (1 + weight) and the router's bias start at zeros
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight" in tensors
    assert "language_model.model.layers.1.self_attn.index_q_proj.weight" in tensors
    for size in (1, 2):  # whole, and split across two ranks (its experts and indexer by their released names)
        engine = _engine(tmp_path, max_num_batched_tokens=32, tensor_parallel_size=size)
        assert engine.model_config.architecture == "MiniMaxM3VLForCausalLM" and engine.model_config.vision is None
        _check_last_logits(engine, model)
        engine.close()
