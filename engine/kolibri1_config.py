"""Aleph Alpha's Kolibri-1 (Kolibri1ForCausalLM) config.json read as transformers reads it, with its defaults where it
leaves them out: EXAONE 4's attention (q and k normed a head, RoPE in the sliding-window layers alone; every fifth
layer full) in GLM-4-0414's layers (each block between two norms), experts in every layer chosen by router logit plus
a learnt bias and weighed by the chosen logits' sigmoids (renormalized by `norm_topk_prob`), beside a shared expert.
Its model is engine/models/glm4.py's Kolibri1ForCausalLM."""
from __future__ import annotations

from engine.layer_lists import check_layer_lists

KOLIBRI1 = "Kolibri1ForCausalLM"
# transformers' Kolibri1Config defaults for what a config.json may leave out.
DEFAULTS = dict(head_dim=128, sliding_window=513, num_experts=384, num_experts_per_tok=6, moe_intermediate_size=512,
                shared_expert_intermediate_size=512, norm_topk_prob=False)


def kolibri1_keys(cfg: dict) -> dict:
    cfg = {**DEFAULTS, **cfg}
    layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types") or ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention"
                                             for i in range(layers)]
    check_layer_lists(layers, layer_types=layer_types)
    return {**cfg, "layer_types": layer_types,
            "num_experts": int(cfg.get("num_local_experts") or cfg["num_experts"])}
