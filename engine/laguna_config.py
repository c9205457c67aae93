"""Laguna's config.json (LagunaForCausalLM) read as transformers reads it: every layer's q heads
(`num_attention_heads_per_layer`), full and sliding-window layers with a RoPE (theta, part of a head) a layer type,
attention's output weighed by the softplus of a projection of the layer's input (a number a head, `gating` true or
"per-head", or one an element), a dense first layer (`mlp_layer_types`), then experts chosen by sigmoid score (of the
router's logits, soft-capped by `moe_router_logit_softcapping` where it is set) plus a learnt bias, renormalized and
scaled by `moe_routed_scaling_factor`, beside an ungated shared expert. Its model is engine/models/laguna.py's."""
from __future__ import annotations

from dataclasses import dataclass

from engine.layer_lists import check_layer_lists

LAGUNA = "LagunaForCausalLM"
ROPE_DEFAULTS = {"full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}


@dataclass(frozen=True)
class LagunaLayout:
    gate_per_element: bool  # attention's output gated an element at a time, else a head at a time


def read_laguna_layout(cfg: dict) -> LagunaLayout:
    return LagunaLayout(gate_per_element=cfg.get("gating", True) == "per-element")


def laguna_keys(cfg: dict) -> dict:
    """ValueError for a layout transformers does not compute."""
    if cfg.get("moe_apply_router_weight_on_input"):
        raise ValueError("Laguna's moe_apply_router_weight_on_input is not supported (transformers computes no such)")
    layers, heads = int(cfg["num_hidden_layers"]), int(cfg.get("num_attention_heads", 48))
    per_layer = cfg.get("num_attention_heads_per_layer") or [heads] * layers
    layer_types = cfg.get("layer_types") or ["full_attention"] * layers
    check_layer_lists(layers, num_attention_heads_per_layer=per_layer, layer_types=layer_types)
    gating = cfg.get("gating", True)
    if gating not in (True, "per-head", "per-element"):
        raise ValueError(f"gating {gating!r} is not one transformers reads (true, 'per-head' or 'per-element')")
    cfg = {key: value for key, value in cfg.items() if key != "partial_rotary_factor"}  # each layer type's own
    return {**cfg, "num_attention_heads_per_layer": [int(n) for n in per_layer], "layer_types": layer_types,
            "mlp_layer_types": cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1),
            "rope_parameters": cfg.get("rope_parameters") or ROPE_DEFAULTS}
