"""JetBrains' Mellum 2 (MellumForCausalLM) config.json read as transformers reads it: Qwen3-MoE's attention (q and k
normed a head) in full and sliding-window layers (`layer_types`) with a RoPE theta a layer type, as Laguna's, and each
layer's MLP dense or Qwen3-MoE's experts (`mlp_layer_types`: softmax over every expert, the top k renormalized by
`norm_topk_prob`). Its model is the Llama family's; its MTP layer (`mtp.*`) drafts (engine/models/mellum_mtp.py)."""
from __future__ import annotations

from engine.layer_lists import check_layer_lists

MELLUM = "MellumForCausalLM"
# transformers' MellumConfig defaults for what a config.json may leave out.
DEFAULTS = dict(num_attention_heads=32, num_key_value_heads=4, head_dim=128, sliding_window=1024, num_local_experts=64,
                num_experts_per_tok=8, moe_intermediate_size=896, norm_topk_prob=True)
ROPE_DEFAULTS = {"full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}


def mellum_keys(cfg: dict) -> dict:
    """ValueError for a layout transformers does not compute."""
    layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types") or ["full_attention"] * layers
    mlp_types = cfg.get("mlp_layer_types") or ["sparse"] * layers
    check_layer_lists(layers, layer_types=layer_types, mlp_layer_types=mlp_types)
    rope = cfg.get("rope_parameters") or ROPE_DEFAULTS
    if any(float((rope.get(kind) or {}).get("partial_rotary_factor", 1.0)) != 1.0 for kind in ROPE_DEFAULTS):
        # transformers' Mellum builds RoPE a layer type that narrow, then turns whole heads by it and fails
        raise ValueError("a partial_rotary_factor in Mellum's rope_parameters is not supported (transformers' Mellum "
                         "cannot compute it)")
    cfg = {**DEFAULTS, **cfg}
    if cfg.get("num_experts") is not None:  # transformers' other name of num_local_experts
        cfg["num_local_experts"] = cfg["num_experts"]
    return {**cfg, "layer_types": layer_types, "mlp_layer_types": mlp_types, "rope_parameters": rope}
