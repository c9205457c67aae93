"""Cohere's Command A MoE (Cohere2MoeForCausalLM) config.json read as transformers reads it: Command A's layers
(attention and the MLP side by side from one norm, RoPE in the sliding-window layers alone, logits scaled) whose norms
are RMS norms where `rms_norm_eps` is set, a prefix of dense layers (`mlp_layer_types`, or the first
`first_k_dense_replace`; RoPE in all of them where `prefix_dense_sliding_window_pattern` is 1), then experts by the
softmax or the sigmoid (`expert_selection_fn`) of the top-k router logits, beside shared experts summed or averaged
with them (`shared_expert_combination_strategy`)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.layer_lists import check_layer_lists

COHERE2_MOE = "Cohere2MoeForCausalLM"
SCORINGS = {"softmax": "softmax_of_top_k", "sigmoid": "sigmoid_of_top_k"}  # MoEConfig.scoring's names of them


@dataclass(frozen=True)
class Cohere2MoeLayout:
    rms_norms: bool  # RMS norms, else layer norms without a bias (Command A's)
    shared_average: bool  # the routed experts' output and the shared ones' averaged, not summed


def cohere2_moe_keys(cfg: dict) -> dict:
    """The config with every layer's attention and MLP named, as transformers names them; ValueError for what it does
    not compute."""
    layers = int(cfg["num_hidden_layers"])
    dense = int(cfg.get("first_k_dense_replace") or 0)
    dense_pattern, pattern = int(cfg.get("prefix_dense_sliding_window_pattern", 1)), int(
        cfg.get("sliding_window_pattern", 4))
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % dense_pattern else "full_attention" for i in range(dense)] + [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers - dense)]
    mlp_types = cfg.get("mlp_layer_types") or ["dense" if i < dense else "sparse" for i in range(layers)]
    check_layer_lists(layers, layer_types=layer_types, mlp_layer_types=mlp_types)
    if cfg.get("expert_selection_fn", "softmax") not in SCORINGS:
        raise ValueError(f"expert_selection_fn {cfg['expert_selection_fn']!r} is not one transformers computes "
                         "('softmax' or 'sigmoid')")
    if cfg.get("shared_expert_combination_strategy", "average") not in ("sum", "average"):
        raise ValueError(f"shared_expert_combination_strategy {cfg['shared_expert_combination_strategy']!r} is not "
                         "one transformers computes ('sum' or 'average')")
    rms_eps = cfg.get("rms_norm_eps")
    return {**cfg, "layer_types": layer_types, "mlp_layer_types": mlp_types,
            "layer_norm_eps": rms_eps if rms_eps is not None else cfg.get("layer_norm_eps", 1e-5),
            "intermediate_size": int(cfg.get("intermediate_size", 22528)), "head_dim": int(cfg.get("head_dim", 128)),
            "prefix_dense_intermediate_size": cfg.get("prefix_dense_intermediate_size")
            or int(cfg.get("intermediate_size", 22528))}


def read_cohere2_moe_layout(cfg: dict) -> Cohere2MoeLayout:
    """Of cohere2_moe_keys' config."""
    return Cohere2MoeLayout(rms_norms=cfg.get("rms_norm_eps") is not None,
                            shared_average=cfg.get("shared_expert_combination_strategy", "average") == "average")


def dense_rope_layers(cfg: dict) -> frozenset[int]:
    """The dense layers RoPE turns whatever their attention (transformers' `force_rope`)."""
    if int(cfg.get("prefix_dense_sliding_window_pattern", 1)) != 1:
        return frozenset()
    return frozenset(i for i, kind in enumerate(cfg["mlp_layer_types"]) if kind == "dense")
