"""SK Telecom's A.X K1 (AXK1ForCausalLM) config.json read as transformers reads it: DeepSeek-V3's model (latent
attention, grouped sigmoid routing beside a shared expert) with the experts' output RMS-normed (`post_mlp_layernorm`),
its dense layers by `mlp_layer_types`, or the first `first_k_dense_replace` and then all but every `moe_layer_freq`-th.
Its model is engine/models/deepseek_v3.py's AXK1ForCausalLM."""
from __future__ import annotations

AXK1 = "AXK1ForCausalLM"


def axk1_keys(cfg: dict) -> dict:
    layers = int(cfg["num_hidden_layers"])
    first, every = int(cfg.get("first_k_dense_replace", 1)), int(cfg.get("moe_layer_freq", 1))
    types = ["sparse" if i >= first and i % every == 0 else "dense" for i in range(layers)]
    return {**cfg, "mlp_layer_types": cfg.get("mlp_layer_types") or types}
