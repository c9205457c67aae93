"""Tencent's Hy3 (HYV3ForCausalLM; engine/hy_v3_config.py): Llama's layers, q and k normed a head, experts routed as
GLM-4.5's (in one group) beside shared experts, read by its own names of the router, its bias and the shared MLP."""
from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class HYV3ForCausalLM(LlamaForCausalLM):
    renames = ((".mlp.router.gate.", ".mlp.gate."), (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"),
               (".mlp.shared_mlp.", ".mlp.shared_experts."))
    has_mtp_layers = True  # released with an MTP layer past its own (transformers leaves it unread too)
