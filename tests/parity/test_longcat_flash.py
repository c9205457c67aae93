"""LongCat-Flash's config and checkpoint as Baton reads them, and what it refuses of them. Its logits and greedy
tokens against transformers are test_transformers_parity.py's (TINY_MODELS["longcat-flash"])."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model_config_loader import ModelConfigError, load_model_config
from tests.parity.conftest import copied_with_config
from tests.parity.test_transformers_parity import _check_logits


def _copy(tiny_model_dirs, tmp_path, changes: dict | None = None, removed: tuple[str, ...] = ()):
    return copied_with_config(tiny_model_dirs["longcat-flash"], tmp_path, changes or {}, removed)


def test_its_layers_are_read_as_two_sublayers_each_with_experts_that_compute_nothing(tiny_model_dirs):
    saved = json.loads((tiny_model_dirs["longcat-flash"] / "config.json").read_text())
    config = load_model_config(tiny_model_dirs["longcat-flash"])
    assert saved["num_layers"] == 2 and config.num_layers == config.num_kv_layers == 4
    assert (config.moe.num_experts, config.moe.identity_experts, config.moe.num_experts_per_tok) == (4, 2, 2)
    assert config.intermediate_size == saved["ffn_hidden_size"]
    assert not any(config.moe.is_sparse(layer) for layer in range(4))  # the sublayers' MLPs: the experts stand beside


def test_its_default_rope_theta_is_transformers(tiny_model_dirs, tmp_path):
    model_dir = _copy(tiny_model_dirs, tmp_path, {"rope_parameters": None}, ("rope_theta",))
    assert load_model_config(model_dir).rope_theta == 10_000_000.0


def test_the_projections_transformers_saves_for_experts_that_compute_nothing_and_its_mtp_layer_are_left_unread(
        tiny_model_dirs, tmp_path):
    model_dir = _copy(tiny_model_dirs, tmp_path)
    tensors = load_file(model_dir / "model.safetensors")
    assert "model.layers.0.mlp.experts.5.gate_proj.weight" in tensors  # experts 4 and 5 compute nothing
    save_file({**tensors, "model.mtp.layers.0.eh_proj.weight": torch.zeros(64, 128)}, model_dir / "model.safetensors")
    _check_logits(model_dir, prompt_lengths=(17,))


@pytest.mark.parametrize("changes, refused", [({"router_bias": True}, "router_bias is not supported")])
def test_what_it_cannot_serve_is_refused_by_name(tiny_model_dirs, tmp_path, changes, refused):
    with pytest.raises(ModelConfigError, match=refused):
        load_model_config(_copy(tiny_model_dirs, tmp_path, changes))
