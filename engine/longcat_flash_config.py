"""Meituan's LongCat-Flash (LongcatFlashForCausalLM: LongCat-Flash-Chat, -Thinking), read from its config.json: each of
its `num_layers` layers is two sublayers of DeepSeek-V3's latent attention and a dense MLP, and a mixture of experts
beside them (shortcut-connected: fed what the first sublayer's MLP is fed, added after the second), whose router
may send a token to `zero_expert_num` experts that compute nothing (the token as it is) as well as to real ones.
Baton counts its sublayers as the model's layers (engine/models/longcat_flash.py)."""
from __future__ import annotations

LONGCAT_FLASH = "LongcatFlashForCausalLM"
DEFAULT_ROPE_THETA = 10_000_000.0  # transformers' LongcatFlashConfig.default_theta


def longcat_flash_keys(cfg: dict) -> dict:
    """`cfg` with its settings under the names the other architectures give them (as transformers' attribute_map
    reads them), its sublayers for its layers, and transformers' defaults where it leaves them out. ValueError for
    what transformers would not compute as its checkpoint says."""
    if cfg.get("router_bias"):  # transformers' router computes without it
        raise ValueError("LongCat-Flash's router_bias is not supported (transformers' router leaves it out)")
    given = {"num_hidden_layers": 2 * int(cfg.get("num_layers", 28)),
             "intermediate_size": cfg.get("ffn_hidden_size", 12288),
             "num_experts_per_tok": cfg.get("moe_topk", 12),
             "moe_intermediate_size": cfg.get("expert_ffn_hidden_size", 2048),
             "n_routed_experts": cfg.get("n_routed_experts", 512),
             "num_key_value_heads": cfg.get("num_key_value_heads") or cfg.get("num_attention_heads", 64)}
    rope = cfg.get("rope_parameters") or {}
    if cfg.get("rope_theta") is None and rope.get("rope_theta") is None:
        given["rope_theta"] = DEFAULT_ROPE_THETA
    return {**cfg, **given}

