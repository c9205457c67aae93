"""DBRX's config.json (DbrxForCausalLM: DBRX Base and Instruct) read by the usual names: its attention settings under
`attn_config`, its experts' under `ffn_config`. Its model is engine/models/mpt.py's DbrxForCausalLM.

RoPE's theta: the top level's where given (transformers 5 saves it there), else `attn_config`'s, as released (500000
for DBRX; transformers reads only the top level's and so turns a released checkpoint by its default, 10000)."""
from __future__ import annotations

DBRX = "DbrxForCausalLM"


def dbrx_keys(cfg: dict) -> dict:
    """ValueError for a layout Baton does not serve."""
    attention, experts = cfg.get("attn_config") or {}, cfg.get("ffn_config") or {}
    normalized = experts.get("moe_normalize_expert_weights", 1.0)
    if normalized not in (None, 1, 1.0):  # the chosen experts' weights divided by their p-norm
        raise ValueError(f"DBRX's moe_normalize_expert_weights {normalized} (a p-norm other than 1) is not supported")
    top = cfg.get("rope_parameters") or {}
    theta = top.get("rope_theta") or cfg.get("rope_theta") or attention.get("rope_theta", 10000.0)
    width = int(experts.get("ffn_hidden_size", 3584))
    return {**cfg, "hidden_size": int(cfg.get("d_model", 2048)), "num_attention_heads": int(cfg.get("n_heads", 16)),
            "num_key_value_heads": int(attention.get("kv_n_heads", 1)),
            "num_hidden_layers": int(cfg.get("n_layers", 24)),
            "max_position_embeddings": int(cfg.get("max_seq_len", 2048)), "intermediate_size": width,
            "moe_intermediate_size": width, "num_local_experts": int(experts.get("moe_num_experts", 4)),
            "num_experts_per_tok": int(experts.get("moe_top_k", 1)), "norm_topk_prob": normalized is not None,
            "hidden_act": (experts.get("ffn_act_fn") or {}).get("name", "silu"), "clip_qkv": attention.get("clip_qkv"),
            "rope_parameters": {**top, "rope_type": top.get("rope_type", "default"), "rope_theta": float(theta)},
            "tie_word_embeddings": False}
