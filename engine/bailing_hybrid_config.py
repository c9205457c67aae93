"""inclusionAI's Ling 3 (BailingHybridForCausalLM: Ling-3.0-Flash), read from its config.json as transformers reads it:
Kimi Delta Attention layers (engine/models/kimi_linear.py) with a full forget gate, bounded below where
`kda_safe_gate` says, and the last layer of every `layer_group_size` DeepSeek-V3's latent attention with RoPE and a
gate a head; DeepSeek-V3's experts after the first dense layers. Its settings go by Ling's names (`num_experts`,
`num_expert_group`, ...), as Kimi-Linear's do.
"""
from __future__ import annotations

BAILING_HYBRID = "BailingHybridForCausalLM"
# transformers' BailingHybridConfig defaults where they differ from DeepSeek-V3's, by DeepSeek-V3's names.
DEFAULTS = dict(vocab_size=157184, hidden_size=2560, intermediate_size=6144, moe_intermediate_size=768,
                num_hidden_layers=42, num_attention_heads=32, n_routed_experts=512,
                first_k_dense_replace=2, rms_norm_eps=1e-6, max_position_embeddings=262144, q_lora_rank=None,
                rope_theta=6_000_000.0, tie_word_embeddings=False)
# Ling's names for settings DeepSeek-V3 names otherwise.
ALIASES = {"model_max_length": "max_position_embeddings", "moe_renormalize": "norm_topk_prob",
           "num_expert_group": "n_group", "num_experts": "n_routed_experts",
           "num_experts_per_token": "num_experts_per_tok", "num_shared_experts": "n_shared_experts",
           "num_mtp_layers": "num_nextn_predict_layers"}


def bailing_hybrid_keys(cfg: dict) -> dict:
    """`cfg` by DeepSeek-V3's names (those given under them win), transformers' defaults filled in, and its KDA
    layers' heads by the names Kimi-Linear's are read by: its `head_dim` (as released) or `linear_head_dim` (as
    transformers saves it, `head_dim` then MLA's RoPE part), as many heads as attention's."""
    cfg = {**DEFAULTS, **{ALIASES[key]: value for key, value in cfg.items() if key in ALIASES}, **cfg}
    layers, group = int(cfg["num_hidden_layers"]), int(cfg.get("layer_group_size", 6))
    kinds = cfg.get("layer_types") or ["full_attention" if (i + 1) % group == 0 else "linear_attention"
                                       for i in range(layers)]
    return {**cfg, "layer_types": kinds, "linear_head_dim": int(cfg.get("linear_head_dim") or cfg.get("head_dim", 128)),
            "linear_num_heads": int(cfg.get("linear_num_heads") or cfg["num_attention_heads"]),
            "linear_conv_kernel_dim": int(cfg.get("linear_conv_kernel_dim") or cfg.get("short_conv_kernel_size", 4)),
            "mlp_layer_types": cfg.get("mlp_layer_types") or ["dense" if i < int(cfg["first_k_dense_replace"])
                                                              else "sparse" for i in range(layers)]}


def forget_gate_bound(cfg: dict) -> float | None:
    """The KDA forget gate's lower bound in log space where `kda_safe_gate` bounds it (its default); None: Kimi's
    unbounded gate."""
    return float(cfg.get("kda_lower_bound", -5.0)) if cfg.get("kda_safe_gate", True) else None
