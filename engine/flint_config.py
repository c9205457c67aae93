"""Recursive's Flint (FlintForCausalLM) config.json read as transformers reads it, with its defaults where it leaves
them out: Qwen3-MoE's attention (q and k normed a head) with a learnt sink a head in every layer, full layers (the
first two, every fourth from the second, the last) beside sliding-window ones, dense MLPs in `mlp_only_layers`
([0, 1]), then experts by the sigmoid of their router logits (top-k, renormalized by `norm_topk_prob`) beside an
ungated shared expert. Its model is the Llama family's."""
from __future__ import annotations

from engine.layer_lists import check_layer_lists

FLINT = "FlintForCausalLM"
# transformers' FlintConfig defaults for what a config.json may leave out.
DEFAULTS = dict(head_dim=128, sliding_window=513, num_experts=256, num_experts_per_tok=6, moe_intermediate_size=512,
                shared_expert_intermediate_size=1024, norm_topk_prob=True, mlp_only_layers=[0, 1])


def flint_keys(cfg: dict) -> dict:
    cfg = {**DEFAULTS, **{key: value for key, value in cfg.items() if value is not None}}
    layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types") or ["full_attention" if i < 2 or i % 4 == 1 or i == layers - 1
                                             else "sliding_attention" for i in range(layers)]
    check_layer_lists(layers, layer_types=layer_types)
    if cfg.get("attention_bias"):
        raise ValueError("attention_bias is not supported for Flint (transformers' has none)")
    return {**cfg, "layer_types": layer_types, "num_experts": int(cfg.get("num_local_experts") or cfg["num_experts"])}
