"""GPT-Neo's config.json (GPTNeoForCausalLM: EleutherAI's GPT-Neo 125M to 2.7B) read by the usual names, with
transformers' defaults where it leaves them out: its layers' kinds from `attention_types` (runs of "global" and "local"
layers, the local ones attending over the last `window_size` positions). Its model is engine/models/opt.py's."""
from __future__ import annotations

GPT_NEO = "GPTNeoForCausalLM"


def gpt_neo_keys(cfg: dict) -> dict:
    """ValueError where its layers' kinds do not add up to its layers."""
    layers, heads = int(cfg.get("num_layers", 24)), int(cfg.get("num_heads", 16))
    hidden = int(cfg.get("hidden_size", 2048))
    kinds = [kind for names, count in cfg.get("attention_types") or [[["global", "local"], 12]]
             for _ in range(count) for kind in names]
    if len(kinds) != layers or not set(kinds) <= {"global", "local"}:
        raise ValueError(f"attention_types must give 'global' or 'local' for each of its {layers} layers")
    return {**cfg, "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": heads,
            "num_hidden_layers": layers, "intermediate_size": int(cfg.get("intermediate_size") or 4 * hidden),
            "hidden_act": cfg.get("activation_function", "gelu_new"),
            "sliding_window": int(cfg.get("window_size", 256)),
            "layer_types": ["sliding_attention" if kind == "local" else "full_attention" for kind in kinds],
            "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}
