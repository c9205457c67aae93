"""Tencent's Hy3 (HYV3ForCausalLM) config.json read by the usual names, with transformers' defaults where it leaves
them out: Llama's attention with q and k normed a head, a dense first layer (`mlp_layer_types`), then experts chosen by
sigmoid score plus a learnt bias, renormalized and scaled by `router_scaling_factor`, beside shared experts."""
from __future__ import annotations

HY_V3 = "HYV3ForCausalLM"
DEFAULT_THETA = 11_158_840.0  # transformers' HYV3Config.default_theta


def hy_v3_keys(cfg: dict) -> dict:
    layers = int(cfg.get("num_hidden_layers", 80))
    given_rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return {**cfg, "routed_scaling_factor": float(cfg.get("router_scaling_factor", 2.826)),
            "n_routed_experts": int(cfg.get("num_experts") or cfg.get("num_local_experts") or 192),
            "num_experts_per_tok": int(cfg.get("num_experts_per_tok") or 8),
            "n_shared_experts": int(cfg.get("num_shared_experts") or 1),
            "mlp_layer_types": cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1),
            "rope_theta": given_rope.get("rope_theta", cfg.get("rope_theta", DEFAULT_THETA))}
