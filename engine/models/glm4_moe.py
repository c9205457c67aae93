"""GLM-4.5 and 4.6 (Glm4MoeForCausalLM): Llama's layers with RoPE over half of each head, optional
q/k norms, q/k/v biases, dense MLPs in the first layers and experts after them, routed by sigmoid
scores within groups beside shared experts (engine/moe_config.py, engine/models/moe.py)."""
from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Glm4MoeForCausalLM(LlamaForCausalLM):
    def is_unused_tensor(self, name: str) -> bool:
        # The checkpoint's layers past the model's are its multi-token-prediction layers, which only
        # speculative decoding reads; transformers leaves them unread too.
        parts = name.split(".")
        return len(parts) > 2 and parts[:2] == ["model", "layers"] and int(parts[2]) >= self.config.num_layers
