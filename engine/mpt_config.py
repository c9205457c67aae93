"""MPT's config.json (MptForCausalLM: MPT-7B, 30B and their chat/instruct releases) read by the usual names, as
transformers reads it: its attention settings nested in `attn_config`, its MLP four times its width whatever
`expansion_ratio` says. Its model is engine/models/mpt.py's."""
from __future__ import annotations

MPT = "MptForCausalLM"
ATTENTION_DEFAULTS = {"attn_type": "multihead_attention", "clip_qkv": None, "softmax_scale": None, "prefix_lm": False,
                      "qk_ln": False, "attn_uses_sequence_id": False, "alibi": True, "alibi_bias_max": 8}


def mpt_keys(cfg: dict) -> dict:
    """ValueError for a layout Baton does not serve (none of MosaicML's releases has one)."""
    attention = {**ATTENTION_DEFAULTS, **(cfg.get("attn_config") or {})}
    # (transformers' slopes run from 2^(-8 / n) whatever alibi_bias_max says: another is refused, not ignored)
    for key, served in (("attn_type", "multihead_attention"), ("prefix_lm", False), ("qk_ln", False),
                        ("attn_uses_sequence_id", False), ("alibi", True), ("alibi_bias_max", 8)):
        if attention[key] != served:
            raise ValueError(f"MPT's attn_config {key}={attention[key]!r} is not supported")
    if cfg.get("logit_scale") is not None:
        raise ValueError("MPT's logit_scale is not supported")
    hidden, heads = int(cfg.get("d_model", 2048)), int(cfg.get("n_heads", 16))
    return {**cfg, "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": heads,
            "num_hidden_layers": int(cfg.get("n_layers", 24)), "intermediate_size": 4 * hidden,
            "max_position_embeddings": int(cfg.get("max_seq_len", 2048)),
            "vocab_size": int(cfg.get("vocab_size", 50368)),
            "hidden_act": "gelu", "tie_word_embeddings": cfg.get("tie_word_embeddings", True),
            "clip_qkv": attention["clip_qkv"], "softmax_scale": attention["softmax_scale"]}
