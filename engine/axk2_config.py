"""SK Telecom's A.X K2 (AXK2ForCausalLM) config.json read as transformers reads it: DeepSeek-V3.2's model (latent
attention made sparse by an indexer, sigmoid routing beside a shared expert; in one group where `n_group` is left
out, A.X K2 Light's) with q's up-projection fused with an output gate a head (`q_b_proj` reads q's normed latent and the
latent itself, and gives each head's q, then its gate, whose sigmoid weighs the head's output), and norms gated by a
low-rank MLP of their output (`gated_norm_rank`; before attention in every layer, before the MLP in the expert
layers). Its dense layers by `mlp_layer_types`, or the first `first_k_dense_replace` and then all but every
`moe_layer_freq`-th. Its model is engine/models/deepseek_v3.py's AXK2ForCausalLM."""
from __future__ import annotations

from engine.mla_config import DEEPSEEK_V32

AXK2 = "AXK2ForCausalLM"
# transformers' AXK2Config defaults where they differ from DeepSeek-V3.2's.
DEFAULTS = dict(vocab_size=163840, hidden_size=2048, intermediate_size=5120, moe_intermediate_size=512,
                num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=32, n_shared_experts=1,
                n_routed_experts=128, routed_scaling_factor=2.5, kv_lora_rank=128, q_lora_rank=384,
                qk_rope_head_dim=32, v_head_dim=64, qk_nope_head_dim=64, num_experts_per_tok=8,
                max_position_embeddings=131072, rms_norm_eps=1e-6, index_topk=2048, index_head_dim=128,
                index_n_heads=16, gated_norm_rank=16)


def axk2_keys(cfg: dict) -> dict:
    """ValueError for a layout transformers refuses."""
    cfg = {**DEFAULTS, **cfg}
    if not cfg.get("q_lora_rank"):
        raise ValueError("A.X K2 needs a q_lora_rank (its indexer and output gate read q's latent)")
    if (cfg.get("n_group") is None) != (cfg.get("topk_group") is None):
        raise ValueError("A.X K2's n_group and topk_group must be given together")
    layers = int(cfg["num_hidden_layers"])
    first, every = int(cfg.get("first_k_dense_replace", 1)), int(cfg.get("moe_layer_freq", 1))
    types = ["sparse" if i >= first and i % every == 0 else "dense" for i in range(layers)]
    return {**cfg, "mlp_layer_types": cfg.get("mlp_layer_types") or types,
            "n_group": cfg.get("n_group") or 1, "topk_group": cfg.get("topk_group") or 1}


READ_AS = {AXK2: DEEPSEEK_V32}
