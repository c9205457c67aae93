"""Reflection's Beam (BeamForCausalLM: Beam-1.0-501B-A23B), read from its config.json as transformers reads it:
Qwen3-MoE's attention with each head's output gated, in sliding-window layers with RoPE and full layers without it
(their q scaled by position instead: engine/attention_layout.py's QTemperature), four norms a layer and residuals
weighed by depth, dense MLPs in the first layers and DeepSeek-V3's grouped routing after them, logits soft-capped.
"""
from __future__ import annotations

BEAM = "BeamForCausalLM"


def beam_keys(cfg: dict) -> dict:
    """`cfg` with transformers' BeamConfig defaults for what it leaves out, and its sliding layers' RoPE (the only
    one it has: its full layers have none) as the model's."""
    layers = int(cfg.get("num_hidden_layers", 52))
    kinds = cfg.get("layer_types")
    if kinds is None:  # every sixth layer full, and the last
        kinds = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
        kinds[-1] = "full_attention"
    rope = cfg.get("rope_parameters") or {}
    sliding_rope = rope.get("sliding_attention", rope) if "full_attention" in rope or "sliding_attention" in rope \
        else rope
    return {**cfg, "layer_types": kinds, "sliding_window": cfg.get("sliding_window", 512),
            "mlp_layer_types": cfg.get("mlp_layer_types") or ["dense" if i < min(3, layers) else "sparse"
                                                              for i in range(layers)],
            "n_routed_experts": cfg.get("num_experts", 256), "n_shared_experts": 0,
            "final_logit_softcapping": cfg.get("final_logit_softcapping", 30.0),
            "rope_parameters": sliding_rope or {"rope_type": "default", "rope_theta": 10000.0}}
