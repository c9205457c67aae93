"""TII's Falcon (FalconForCausalLM: Falcon-7B, 40B, 180B), read from its config.json into the usual names: its layer
norms with biases, an ungated GELU MLP (`dense_h_to_4h`, `dense_4h_to_h`), RoPE, and attention beside the MLP
(`parallel_attn`) from one norm (7B's) or one each (`new_decoder_architecture`: 40B's and 180B's), q, k and v fused
(engine/models/falcon.py)."""
from __future__ import annotations

FALCON = "FalconForCausalLM"


def falcon_keys(cfg: dict) -> dict:
    """`cfg` by the usual names, with transformers' defaults where it leaves them out. ValueError for a layout Baton
    does not serve."""
    if cfg.get("alibi"):
        raise ValueError("Falcon with ALiBi positions (falcon-rw's) is not supported")
    new_layout = bool(cfg.get("new_decoder_architecture", False))
    if new_layout and not cfg.get("parallel_attn", True):
        raise ValueError("Falcon's new_decoder_architecture without parallel_attn is not supported")
    heads = int(cfg.get("num_attention_heads") or cfg["n_head"])
    kv_heads = int(cfg.get("num_kv_heads") or cfg.get("n_head_kv") or heads) if new_layout else \
        1 if cfg.get("multi_query", True) else heads
    hidden = int(cfg["hidden_size"])
    return {**cfg, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "num_hidden_layers": int(cfg.get("num_hidden_layers") or cfg["n_layer"]),
            "intermediate_size": int(cfg.get("ffn_hidden_size") or 4 * hidden),
            "hidden_act": cfg.get("activation", "gelu"), "attention_bias": bool(cfg.get("bias", False)),
            "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}


def falcon_norms(cfg: dict) -> int:
    """The layer norms a layer has before its attention and MLP side by side (1 or 2), or 0: one before each in turn."""
    if cfg.get("new_decoder_architecture"):
        return int(cfg.get("num_ln_in_parallel_attn") or 2)
    return 1 if cfg.get("parallel_attn", True) else 0
