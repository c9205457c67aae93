"""BLOOM's config.json (BloomForCausalLM: BLOOM, BLOOMZ) read by the usual names, with transformers' defaults where it
leaves them out; its model is engine/models/layer_norm_llama.py's BloomForCausalLM."""
from __future__ import annotations

BLOOM = "BloomForCausalLM"


def bloom_keys(cfg: dict) -> dict:
    """ValueError for a layout Baton does not serve."""
    if cfg.get("apply_residual_connection_post_layernorm"):
        raise ValueError("BLOOM's apply_residual_connection_post_layernorm (the residual taken after each norm) is not "
                         "supported")
    hidden = int(cfg.get("hidden_size") or cfg.get("n_embed") or 64)  # (transformers' defaults: BloomConfig's)
    heads = int(cfg.get("num_attention_heads") or cfg.get("n_head", 8))
    return {**cfg, "hidden_size": hidden,
            "num_hidden_layers": int(cfg.get("num_hidden_layers") or cfg.get("n_layer", 2)),
            "num_attention_heads": heads, "num_key_value_heads": heads,  # each head its own k and v, whatever it says
            "intermediate_size": 4 * hidden, "hidden_act": "gelu_pytorch_tanh",
            "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}
