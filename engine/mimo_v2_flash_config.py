"""Xiaomi's MiMo-V2-Flash (MiMoV2FlashForCausalLM) config.json read as transformers reads it, with its defaults where
it leaves them out: full-attention layers (the first and every sixth) beside sliding-window ones with twice the KV
heads and a sink a head, q and k heads `head_dim` wide and v heads `v_head_dim` (values scaled by
`attention_value_scale`), RoPE over part of each head at a theta a layer type, a dense first MLP (`mlp_layer_types`),
then DeepSeek-V3's routing (sigmoid score plus a correction bias) without shared experts. Its model is
engine/models/mimo_v2_flash.py's; its MTP layers (`model.mtp.`) are left unread."""
from __future__ import annotations

from dataclasses import dataclass

from engine.layer_lists import check_layer_lists

MIMO_V2_FLASH = "MiMoV2FlashForCausalLM"
ROPE_DEFAULTS = {"full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.334},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.334}}
# transformers' MiMoV2FlashConfig defaults (past those of GLM-4.5's it builds on) for what a config.json may leave out.
DEFAULTS = dict(num_attention_heads=64, num_key_value_heads=4, head_dim=192, v_head_dim=128, sliding_window=129,
                n_routed_experts=256, moe_intermediate_size=2048, num_experts_per_tok=8, norm_topk_prob=True)


@dataclass(frozen=True)
class MiMoV2FlashLayout:
    v_head_dim: int  # each v head's width (q's and k's: head_dim); widened with zeros in the pages
    value_scale: float  # v's projection scaled by it
    full_kv_heads: int  # a full layer's KV heads, every other one of its pages' (a sliding layer's: all, twice as many)


def mimo_v2_flash_keys(cfg: dict) -> dict:
    """The config with transformers' defaults filled in; its pages hold the sliding layers' KV heads. ValueError for a
    layout transformers does not compute."""
    cfg = {**DEFAULTS, **cfg}
    layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types") or ["full_attention" if i == 0 or not (i + 1) % 6 else "sliding_attention"
                                             for i in range(layers)]
    mlp_types = cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
    check_layer_lists(layers, layer_types=layer_types, mlp_layer_types=mlp_types)
    if cfg.get("attention_bias"):
        raise ValueError("attention_bias is not supported for MiMo-V2-Flash (its releases have none)")
    if int(cfg["v_head_dim"]) > int(cfg["head_dim"]):
        raise ValueError(f"v_head_dim {cfg['v_head_dim']} past head_dim {cfg['head_dim']} is not supported")
    window = cfg["sliding_window"] if cfg.get("sliding_window_size") is None else int(cfg["sliding_window_size"]) + 1
    cfg = {key: value for key, value in cfg.items() if key != "partial_rotary_factor"}  # each layer type's own
    heads = int(cfg["num_attention_heads"])
    return {**cfg, "layer_types": layer_types, "mlp_layer_types": mlp_types, "sliding_window": window,
            "num_attention_heads_per_layer": [heads] * layers,
            "num_key_value_heads": 2 * int(cfg["num_key_value_heads"]) if "sliding_attention" in layer_types
            else int(cfg["num_key_value_heads"]),
            "full_attention_kv_heads": int(cfg["num_key_value_heads"]),
            "rope_parameters": cfg.get("rope_parameters") or ROPE_DEFAULTS,
            "routed_scaling_factor": cfg.get("routed_scaling_factor") or 1.0, "n_shared_experts": 0}


def read_mimo_v2_flash_layout(cfg: dict) -> MiMoV2FlashLayout:
    """Of mimo_v2_flash_keys' config."""
    scale = cfg.get("attention_value_scale", 0.707)
    return MiMoV2FlashLayout(v_head_dim=int(cfg["v_head_dim"]), value_scale=1.0 if scale is None else float(scale),
                             full_kv_heads=int(cfg["full_attention_kv_heads"]))
