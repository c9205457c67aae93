"""GLM-4.5 and 4.6 (Glm4MoeForCausalLM): Llama's layers with RoPE over half of each head, optional
q/k norms, q/k/v biases, dense MLPs in the first layers and experts after them, routed by sigmoid
scores within groups beside shared experts (engine/moe_config.py, engine/models/moe.py)."""
from __future__ import annotations

import torch

from engine.models.llama import LlamaForCausalLM


class Glm4MoeForCausalLM(LlamaForCausalLM):
    has_mtp_layers = True


class SarvamMoEForCausalLM(Glm4MoeForCausalLM):
    """Sarvam-30B (engine/sarvam_config.py): GLM-4.5's model, its checkpoints' q, k and v fused ([q | k | v] rows, as
    Baton keeps them) and its other tensors under their own names."""

    renames = (("model.word_embeddings.", "model.embed_tokens."),
               (".attention.query_key_value.", ".self_attn.qkv_proj."), (".attention.dense.", ".self_attn.o_proj."),
               (".attention.query_layernorm.", ".self_attn.q_norm."),
               (".attention.key_layernorm.", ".self_attn.k_norm."),
               (".mlp.gate.expert_bias", ".mlp.gate.e_score_correction_bias"))

    def _attention_names(self, layer: int) -> list[str]:
        p = f"model.layers.{layer}.self_attn."
        apart = (p + "k_proj.", p + "v_proj.")
        return [name.replace(p + "q_proj.", p + "qkv_proj.") for name in super()._attention_names(layer)
                if not name.startswith(apart)]

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".")
        if len(parts) == 6 and parts[4] == "qkv_proj":
            attn = self.layers[int(parts[2])].attn
            return (attn.qkv_weight if parts[5] == "weight" else attn.qkv_bias).data
        return super()._target(name)

