"""GPT-J's config.json (GPTJForCausalLM: GPT-J-6B and its fine-tunes) read by the usual names, with transformers'
defaults where it leaves them out; its model is engine/models/layer_norm_llama.py's GPTJForCausalLM."""
from __future__ import annotations

GPTJ = "GPTJForCausalLM"


def gptj_keys(cfg: dict) -> dict:
    hidden, heads = int(cfg.get("n_embd", 4096)), int(cfg.get("n_head", 16))
    rotary = cfg.get("rotary_dim", 64)  # the dimensions of a head RoPE turns; None: all
    return {**cfg, "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": heads,
            "num_hidden_layers": int(cfg.get("n_layer", 28)),
            "intermediate_size": int(cfg.get("n_inner") or 4 * hidden),
            "max_position_embeddings": int(cfg.get("n_positions", 2048)),
            "hidden_act": cfg.get("activation_function", "gelu_new"),
            "partial_rotary_factor": int(rotary) / (hidden // heads) if rotary else 1.0,
            "tie_word_embeddings": cfg.get("tie_word_embeddings", False)}
