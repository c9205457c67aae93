"""GLM-4.5 and 4.6 (Glm4MoeForCausalLM): Llama's layers with RoPE over half of each head, optional
q/k norms, q/k/v biases, dense MLPs in the first layers and experts after them, routed by sigmoid
scores within groups beside shared experts (engine/moe_config.py, engine/models/moe.py)."""
from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Glm4MoeForCausalLM(LlamaForCausalLM):
    has_mtp_layers = True
