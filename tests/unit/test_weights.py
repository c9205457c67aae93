"""Checkpoint problems are errors that name the file and the tensor."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint import WeightsError, checkpoint_files, kv_fingerprint, model_fingerprint
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_config_loader import ModelConfigError, load_model_config


@pytest.fixture
def model_copy(tiny_demo_model, tmp_path):
    return shutil.copytree(tiny_demo_model, tmp_path / "model")


def load(model_dir):
    return LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=8))


def test_unsupported_architecture_is_named(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["architectures"] = ["RwkvForCausalLM"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match=r"config\.json: unsupported architecture .*RwkvForCausalLM"):
        load_model_config(model_copy)


@pytest.mark.parametrize("architecture", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_qwens_sliding_window_layers_are_refused(model_copy, architecture):
    # Their layers may alternate full and windowed attention; Baton's one window would be wrong for some.
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg.update(architectures=[architecture], use_sliding_window=True, sliding_window=64)
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="use_sliding_window"):
        load_model_config(model_copy)
    cfg["use_sliding_window"] = False
    (model_copy / "config.json").write_text(json.dumps(cfg))
    config = load_model_config(model_copy)
    assert config.sliding_window is None and config.qk_norm == ("head" if architecture == "Qwen3ForCausalLM" else None)


def test_yarns_original_context_and_factor_are_read_as_transformers_reads_them(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg.update(max_position_embeddings=4096, rope_scaling={"type": "yarn", "original_max_position_embeddings": 512})
    (model_copy / "config.json").write_text(json.dumps(cfg))
    scaling = load_model_config(model_copy).rope_scaling
    assert (scaling["rope_type"], scaling["factor"], scaling["original_max_position_embeddings"]) == ("yarn", 8.0, 512)
    cfg["original_max_position_embeddings"] = 1024  # a top-level field wins (Phi-3 writes it there)
    (model_copy / "config.json").write_text(json.dumps(cfg))
    assert load_model_config(model_copy).rope_scaling["factor"] == 4.0


def test_which_layers_have_experts_is_read_as_qwen3_moe_places_them(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg.update(architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=6, num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=[3])
    (model_copy / "config.json").write_text(json.dumps(cfg))
    config = load_model_config(model_copy)
    assert (config.moe.num_experts, config.moe.norm_topk_prob) == (8, False)
    assert config.moe.dense_layers == {0, 2, 3, 4}  # every second layer has experts, but for layer 3
    cfg["num_experts_per_tok"] = 9
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="num_experts_per_tok 9"):
        load_model_config(model_copy)


def test_a_qwen2_moe_config_is_read_as_transformers_reads_it(model_copy):
    # As Qwen1.5-MoE's hub config has it: no qkv_bias field (its q, k and v have biases), a shared expert.
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg.update(architectures=["Qwen2MoeForCausalLM"], num_experts=60, num_experts_per_tok=4, moe_intermediate_size=32,
               shared_expert_intermediate_size=128)
    (model_copy / "config.json").write_text(json.dumps(cfg))
    config = load_model_config(model_copy)
    assert (config.moe.num_experts, config.moe.shared_expert_intermediate_size, config.moe.dense_layers) == \
        (60, 128, set())
    assert config.qkv_bias and not config.o_bias and not config.qk_norm
    (model_copy / "config.json").write_text(json.dumps({**cfg, "qkv_bias": False}))
    assert not load_model_config(model_copy).qkv_bias
    (model_copy / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True}))
    with pytest.raises(ModelConfigError, match="use_sliding_window"):
        load_model_config(model_copy)


def test_an_older_gemma3_config_is_read_as_transformers_reads_it(model_copy):
    # As Gemma 3 1B's hub config has it: RoPE settings at the top level, a pattern instead of layer types.
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg.update(architectures=["Gemma3ForCausalLM"], hidden_activation="gelu_pytorch_tanh", num_hidden_layers=6,
               rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
               rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window=512, sliding_window_pattern=3,
               query_pre_attn_scalar=256, head_dim=64)
    cfg.pop("hidden_act", None)
    cfg.pop("rope_parameters", None)  # the demo model's, in transformers 5's form
    cfg.pop("tie_word_embeddings", None)
    (model_copy / "config.json").write_text(json.dumps(cfg))
    config = load_model_config(model_copy)
    assert (config.rope_theta, config.rope_scaling["factor"], config.local_rope_theta) == (1e6, 8.0, 1e4)
    assert (config.sliding_window, config.sliding_layers) == (512, {0, 1, 3, 4})
    assert config.attention_scale == 256 ** -0.5 and config.qk_norm == "head"
    assert config.tie_word_embeddings  # not in this config: Gemma 3's default
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (None, None)
    for refused, named in (({"hidden_activation": "silu"}, "hidden_act 'silu'"),
                           ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
                           ({"attn_logit_softcapping": 0}, "attn_logit_softcapping must be positive")):
        (model_copy / "config.json").write_text(json.dumps({**cfg, **refused}))
        with pytest.raises(ModelConfigError, match=named):
            load_model_config(model_copy)


def test_a_dots1_config_is_read_as_transformers_reads_it(model_copy):
    # Without layer types: the layers from max_window_layers on windowed where there is a window (transformers'
    # 4096 where absent, none where null); its routing's defaults (no renormalizing, no dense layer) are dots1's own.
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg.update(architectures=["Dots1ForCausalLM"], num_hidden_layers=5, max_window_layers=3, n_routed_experts=8,
               num_experts_per_tok=2, moe_intermediate_size=48, n_shared_experts=2)
    cfg.pop("layer_types", None)
    for window, windowed in ((64, {3, 4}), (None, set())):
        (model_copy / "config.json").write_text(json.dumps({**cfg, "sliding_window": window}))
        config = load_model_config(model_copy)
        assert (config.sliding_window, config.sliding_layers) == (window, windowed)
    (model_copy / "config.json").write_text(json.dumps(cfg))
    config = load_model_config(model_copy)
    assert (config.sliding_window, config.sliding_layers) == (4096, {3, 4})
    assert (config.qk_norm, config.moe.scoring, config.moe.norm_topk_prob) == ("head", "sigmoid", False)
    assert (config.moe.dense_layers, config.moe.shared_expert_intermediate_size) == (frozenset(), 96)
    (model_copy / "config.json").write_text(json.dumps({**cfg, "max_window_layers": 5}))
    assert load_model_config(model_copy).sliding_window is None


def test_a_hunyuan_a13b_config_is_read_as_released(model_copy):
    # As Hunyuan-A13B's config.json has them: top-k, expert width and shared experts a layer each, alike; its shared
    # MLP switched by use_mixed_mlp_moe. Layers that differ are refused by name (Baton's experts are alike).
    cfg = json.loads((model_copy / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    cfg.update(architectures=["HunYuanMoEV1ForCausalLM"], num_experts=8, moe_topk=[2] * layers,
               moe_intermediate_size=[48] * layers, num_shared_expert=[2] * layers, use_mixed_mlp_moe=True)
    (model_copy / "config.json").write_text(json.dumps(cfg))
    moe = load_model_config(model_copy).moe
    assert (moe.num_experts_per_tok, moe.moe_intermediate_size) == (2, 48)
    assert moe.shared_expert_intermediate_size == 2 * cfg["intermediate_size"]
    (model_copy / "config.json").write_text(json.dumps({**cfg, "use_mixed_mlp_moe": False}))
    assert load_model_config(model_copy).moe.shared_expert_intermediate_size == 0
    (model_copy / "config.json").write_text(json.dumps({**cfg, "moe_topk": [2] + [3] * (layers - 1)}))
    with pytest.raises(ModelConfigError, match="moe_topk .* differs by layer"):
        load_model_config(model_copy)


def test_a_granite_swa_config_is_read_as_transformers_reads_it(model_copy):
    # Without layer types: every fourth layer full from the first, the others windowed (128 where absent); RoPE a
    # layer by layer_rope_theta (0: none), else the model's everywhere; sinks; rms_norm_eps 1e-5 where absent.
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg.update(architectures=["GraniteSWAForCausalLM"], num_hidden_layers=6)
    for absent in ("layer_types", "sliding_window", "rms_norm_eps"):
        cfg.pop(absent, None)
    (model_copy / "config.json").write_text(json.dumps(cfg))
    config = load_model_config(model_copy)
    assert (config.sliding_window, config.sliding_layers) == (128, {1, 2, 3, 5})
    assert (config.rope_layers, config.local_rope_theta) == (frozenset(range(6)), None)
    assert config.attention_sinks and config.rms_norm_eps == 1e-5
    thetas = [0, 1e4, 1e4, 1e4, 0, 1e4]  # NoPE full layers
    (model_copy / "config.json").write_text(json.dumps({**cfg, "layer_rope_theta": thetas}))
    config = load_model_config(model_copy)
    assert (config.rope_layers, config.rope_theta, config.local_rope_theta) == ({1, 2, 3, 5}, 1e4, None)
    thetas = [5e5, 1e4, 1e4, 1e4, 5e5, 1e4]  # a theta for each kind
    (model_copy / "config.json").write_text(json.dumps({**cfg, "layer_rope_theta": thetas}))
    config = load_model_config(model_copy)
    assert (config.rope_layers, config.rope_theta, config.local_rope_theta) == (frozenset(range(6)), 5e5, 1e4)
    for refused, named in (([5e5, 1e4, 2e4, 1e4, 5e5, 1e4], "one theta and the sliding-window layers by one"),
                           ([1e4] * 5, "a theta for each of the 6 layers")):
        (model_copy / "config.json").write_text(json.dumps({**cfg, "layer_rope_theta": refused}))
        with pytest.raises(ModelConfigError, match=named):
            load_model_config(model_copy)


def test_a_gemma_configs_legacy_gelu_is_read_as_transformers_reads_it(model_copy):
    # Gemma 7B's and 2B's releases name their MLP's GELU "gelu"; transformers computes it with the tanh approximation.
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg.update(architectures=["GemmaForCausalLM"], hidden_act="gelu", head_dim=16)
    cfg.pop("tie_word_embeddings", None)
    (model_copy / "config.json").write_text(json.dumps(cfg))
    config = load_model_config(model_copy)
    assert (config.hidden_act, config.tie_word_embeddings, config.mlp_gated) == ("gelu_pytorch_tanh", True, True)
    (model_copy / "config.json").write_text(json.dumps({**cfg, "hidden_act": "relu"}))
    with pytest.raises(ModelConfigError, match="unsupported hidden_act 'relu'"):
        load_model_config(model_copy)


def test_cwm_and_apertus_configs_left_bare_are_read_with_transformers_defaults(model_copy):
    # CWM without layer types: every fourth layer full from the first, the others windowed (8192 where absent); both
    # without RoPE settings: a Llama 3 RoPE (CWM's of theta 1e6, Apertus's 1.2e7); CWM without stop tokens: Llama 3's.
    cfg = json.loads((model_copy / "config.json").read_text())
    for absent in ("layer_types", "sliding_window", "rope_parameters", "rope_scaling", "rope_theta", "eos_token_id"):
        cfg.pop(absent, None)
    (model_copy / "config.json").write_text(json.dumps({**cfg, "architectures": ["CwmForCausalLM"],
                                                        "num_hidden_layers": 6}))
    (model_copy / "generation_config.json").unlink(missing_ok=True)
    config = load_model_config(model_copy)
    assert (config.sliding_window, config.sliding_layers) == (8192, {1, 2, 3, 5})
    assert (config.rope_theta, config.rope_scaling["rope_type"], config.rope_scaling["factor"]) == (1e6, "llama3", 16)
    assert config.eos_token_ids == (128001, 128008, 128009)
    cfg.pop("hidden_act", None)
    (model_copy / "config.json").write_text(json.dumps({**cfg, "architectures": ["ApertusForCausalLM"]}))
    config = load_model_config(model_copy)
    assert (config.rope_theta, config.rope_scaling["factor"], config.hidden_act, config.mlp_gated) == (
        1.2e7, 8.0, "xielu", False)


def test_phimoe_configs_baton_cannot_serve_are_refused_by_name(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 512}
    cfg.update(architectures=["PhimoeForCausalLM"], num_local_experts=4, num_experts_per_tok=2)
    cfg.pop("rope_scaling", None)
    for refused, named in (({"num_experts_per_tok": 3}, "SparseMixer chooses two experts"),
                           ({"rope_parameters": {**rope, "short_mscale": 1.1, "long_mscale": 1.2}},
                            "short_mscale 1.1 and long_mscale 1.2 differ")):
        (model_copy / "config.json").write_text(json.dumps({**cfg, **refused}))
        with pytest.raises(ModelConfigError, match=named):
            load_model_config(model_copy)


def test_opt_layouts_baton_cannot_serve_are_refused_by_name(model_copy):
    # opt-350m's: norms after each block, embeddings projected in and out of the hidden size.
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg.update(architectures=["OPTForCausalLM"], ffn_dim=cfg["intermediate_size"], activation_function="relu")
    for refused, named in (({"do_layer_norm_before": False}, "norms after each block"),
                           ({"word_embed_proj_dim": 16}, "word_embed_proj_dim 16"),
                           ({"activation_function": "gelu"}, "unsupported hidden_act 'gelu'")):
        (model_copy / "config.json").write_text(json.dumps({**cfg, **refused}))
        with pytest.raises(ModelConfigError, match=named):
            load_model_config(model_copy)


def test_a_gpt2_config_is_read_by_its_own_names(model_copy):
    # n_embd, n_head, n_layer, n_positions; n_inner four times the width where null; an attention scaled otherwise
    # than by head_dim ** -0.5 refused by name.
    cfg = json.loads((model_copy / "config.json").read_text())
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "intermediate_size",
                "max_position_embeddings", "hidden_act", "tie_word_embeddings"):
        cfg.pop(key, None)
    cfg.update(architectures=["GPT2LMHeadModel"], n_embd=64, n_head=4, n_layer=3, n_positions=256, n_inner=None,
               activation_function="gelu_new")
    (model_copy / "config.json").write_text(json.dumps(cfg))
    config = load_model_config(model_copy)
    assert (config.hidden_size, config.num_heads, config.num_kv_heads, config.num_layers) == (64, 4, 4, 3)
    assert (config.intermediate_size, config.max_position_embeddings, config.tie_word_embeddings) == (256, 256, True)
    assert (config.hidden_act, config.mlp_gated, config.rope_layers) == ("gelu_pytorch_tanh", False, frozenset())
    (model_copy / "config.json").write_text(json.dumps({**cfg, "scale_attn_by_inverse_layer_idx": True}))
    with pytest.raises(ModelConfigError, match="scale_attn_by_inverse_layer_idx"):
        load_model_config(model_copy)


def test_a_gemma2_config_is_read_as_transformers_reads_it(model_copy):
    # As Gemma 2 2B's hub config has it: no layer types (every other layer windowed, the first too),
    # one RoPE; soft caps given, or transformers' 50 and 30 when absent, or off when null.
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg.update(architectures=["Gemma2ForCausalLM"], hidden_activation="gelu_pytorch_tanh", num_hidden_layers=5,
               rope_theta=10_000.0, sliding_window=4096, query_pre_attn_scalar=256, head_dim=64,
               attn_logit_softcapping=40.0)
    for absent in ("hidden_act", "rope_parameters", "tie_word_embeddings", "final_logit_softcapping"):
        cfg.pop(absent, None)
    (model_copy / "config.json").write_text(json.dumps(cfg))
    config = load_model_config(model_copy)
    assert (config.sliding_window, config.sliding_layers) == (4096, {0, 2, 4})
    assert (config.rope_theta, config.rope_scaling, config.local_rope_theta) == (1e4, None, None)
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (40.0, 30.0)
    assert config.attention_scale == 256 ** -0.5 and not config.qk_norm and config.tie_word_embeddings
    (model_copy / "config.json").write_text(json.dumps({**cfg, "attn_logit_softcapping": None}))
    assert load_model_config(model_copy).attn_logit_softcapping is None


def test_layer_kinds_are_read_as_transformers_reads_olmo3_and_smollm3(model_copy):
    # Without layer_types: OLMo 3 windows three layers in four, its windowed layers' RoPE the model's
    # theta unscaled; SmolLM3 drops RoPE in every no_rope_layer_interval-th layer, windowing those.
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.update(num_hidden_layers=8, rope_theta=5e5, sliding_window=32)
    (model_copy / "config.json").write_text(json.dumps({**cfg, "architectures": ["Olmo3ForCausalLM"]}))
    config = load_model_config(model_copy)
    assert config.sliding_layers == {0, 1, 2, 4, 5, 6} and config.local_rope_theta == 5e5
    assert config.qk_norm == "projection" and config.rope_layers == set(range(8))
    smol = {**cfg, "architectures": ["SmolLM3ForCausalLM"], "no_rope_layer_interval": 3}
    (model_copy / "config.json").write_text(json.dumps(smol))
    config = load_model_config(model_copy)
    assert config.rope_layers == {0, 1, 3, 4, 6, 7} and config.sliding_window is None
    (model_copy / "config.json").write_text(json.dumps({**smol, "use_sliding_window": True}))
    config = load_model_config(model_copy)
    assert (config.sliding_window, config.sliding_layers) == (32, {2, 5})


def test_a_glm4_moe_config_is_read_as_transformers_reads_it(model_copy):
    # As GLM-4.5-Air's hub config has it, less what transformers fills in: RoPE over half of each
    # head, the first layer dense, sigmoid routing within groups.
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.update(architectures=["Glm4MoeForCausalLM"], n_routed_experts=16, num_experts_per_tok=4, n_group=4,
               topk_group=2, moe_intermediate_size=32, routed_scaling_factor=1.5, num_hidden_layers=3)
    (model_copy / "config.json").write_text(json.dumps(cfg))
    config = load_model_config(model_copy)
    assert (config.head_dim, config.rotary_dim, config.rms_norm_eps) == (16, 8, 1e-5)
    moe = config.moe
    assert (moe.scoring, moe.num_groups, moe.topk_groups, moe.routed_scaling_factor) == ("sigmoid", 4, 2, 1.5)
    assert moe.dense_layers == {0} and moe.shared_expert_intermediate_size == 32 and not moe.shared_expert_gated
    assert moe.norm_topk_prob and config.qk_norm is None
    (model_copy / "config.json").write_text(json.dumps({**cfg, "n_group": 16}))  # one expert a group: no best two
    with pytest.raises(ModelConfigError, match="cannot make 16 groups of two or more"):
        load_model_config(model_copy)


def test_soft_caps_are_refused_outside_gemma(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        (model_copy / "config.json").write_text(json.dumps({**cfg, name: 30.0}))
        with pytest.raises(ModelConfigError, match=f"{name} is not supported for LlamaForCausalLM"):
            load_model_config(model_copy)


@pytest.mark.parametrize("where", ["top", "rope_parameters"])
def test_a_partial_rotary_factor_is_read_for_phi3_and_refused_elsewhere(model_copy, where):
    # Phi-4-mini's 0.75 of each head; transformers turns part of a head in Phi-3's attention only.
    cfg = json.loads((model_copy / "config.json").read_text())
    if where == "top":
        cfg["partial_rotary_factor"] = 0.75
    else:
        cfg["rope_parameters"] = {**cfg.get("rope_parameters", {}), "partial_rotary_factor": 0.75}
    for architecture, refused in (("Phi3ForCausalLM", None), ("LlamaForCausalLM", "not supported for Llama")):
        (model_copy / "config.json").write_text(json.dumps({**cfg, "architectures": [architecture]}))
        if refused is None:
            config = load_model_config(model_copy)
            assert (config.head_dim, config.rotary_dim) == (16, 12)
        else:
            with pytest.raises(ModelConfigError, match=f"partial_rotary_factor 0.75 is {refused}"):
                load_model_config(model_copy)
    (model_copy / "config.json").write_text(json.dumps({**cfg, "architectures": ["Phi3ForCausalLM"],
                                                        "partial_rotary_factor": 0.3125}))
    with pytest.raises(ModelConfigError, match="turns 5 of 16 dimensions a head; RoPE needs an even number"):
        load_model_config(model_copy)


def _longrope_config(model_copy, rope_type: str, **scaling) -> dict:
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.update(architectures=["Phi3ForCausalLM"], max_position_embeddings=4096, original_max_position_embeddings=512,
               rope_scaling={"type": rope_type, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, **scaling})
    (model_copy / "config.json").write_text(json.dumps(cfg))
    return cfg


@pytest.mark.parametrize("rope_type", ["longrope", "su", "yarn"])
def test_longrope_is_read_as_transformers_reads_phi3s(model_copy, rope_type):
    # Early Phi-3 configs name it "su" or "yarn"; the factor is the ratio of the contexts.
    _longrope_config(model_copy, rope_type)
    scaling = load_model_config(model_copy).rope_scaling
    assert (scaling["rope_type"], scaling["factor"], scaling["original_max_position_embeddings"]) == \
        ("longrope", 8.0, 512)


def test_longrope_factors_a_frequency_each_or_refused(model_copy):
    _longrope_config(model_copy, "longrope", long_factor=[2.0] * 7)
    with pytest.raises(ModelConfigError, match="longrope's long_factor needs 8 numbers"):
        load_model_config(model_copy)


def test_the_kv_fingerprint_names_longropes_factor_set(model_copy, tiny_demo_model):
    """Workers serving a LongRoPE model with a context past its original one turn keys by other
    factors than those serving it within it: their pages must not pass for each other's."""
    assert kv_fingerprint(tiny_demo_model, 64) == kv_fingerprint(tiny_demo_model, None) == \
        model_fingerprint(tiny_demo_model)
    _longrope_config(model_copy, "longrope")
    short, long = kv_fingerprint(model_copy, 512), kv_fingerprint(model_copy, None)
    assert short == kv_fingerprint(model_copy, 100) and long == kv_fingerprint(model_copy, 513)
    assert len({short, long, model_fingerprint(model_copy)}) == 3


def test_unsupported_rope_scaling_is_named(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "dynamic", "factor": 4.0}
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="unsupported rope_scaling type 'dynamic'"):
        load_model_config(model_copy)


def test_missing_tensor_is_named(model_copy):
    path = model_copy / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(WeightsError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' not found in model\.safetensors"):
        load(model_copy)


def test_a_tensor_no_layer_reads_is_named_and_old_rope_buffers_are_not(model_copy):
    # An o_proj bias in a config that says none: computing without it would be silently wrong.
    path = model_copy / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # older exports saved these
    save_file(tensors, path)
    load(model_copy)
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(tensors["model.norm.weight"].shape)
    save_file(tensors, path)
    with pytest.raises(WeightsError, match=r"'model\.layers\.0\.self_attn\.o_proj\.bias', which Baton's "
                                           r"LlamaForCausalLM does not read"):
        load(model_copy)


def test_truncated_file_is_named(model_copy):
    path = model_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(WeightsError, match=r"model\.safetensors: truncated: tensor '[\w.]+' needs"):
        checkpoint_files(model_copy)


def test_wrong_shape_is_named(model_copy):
    path = model_copy / "model.safetensors"
    tensors = load_file(path)
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape"):
        load(model_copy)


def test_sharded_checkpoint_with_missing_shard(model_copy):
    tensors = load_file(model_copy / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, part in halves.items():
        save_file({n: tensors[n] for n in part}, model_copy / fname)
    (model_copy / "model.safetensors").unlink()
    index = {"weight_map": {n: f for f, part in halves.items() for n in part}}
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    engine = load(model_copy)  # loads from shards
    assert engine.model_config.num_layers == 2
    (model_copy / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightsError, match="shard model-00002-of-00002.safetensors is missing"):
        load(model_copy)
