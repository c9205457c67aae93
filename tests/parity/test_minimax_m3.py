"""MiniMax-M3's text model: its config as Baton reads it and what it refuses of it; its indexer's keys handed over with
the pages. Its logits and greedy tokens against transformers are test_transformers_parity.py's
(TINY_MODELS["minimax-m3"])."""
from __future__ import annotations

import pytest
import torch

from engine.model_config_loader import ModelConfigError, load_model_config
from tests.parity.conftest import copied_with_config, decoded_from_handed_over_pages
from tests.parity.test_transformers_parity import _engine, _hf_model, _random_prompt


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


def test_a_split_across_ranks_is_refused_by_name(tiny_model_dirs):
    with pytest.raises(ValueError, match="tensor parallelism splits"):
        _engine(tiny_model_dirs["minimax-m3"], tensor_parallel_size=2)
