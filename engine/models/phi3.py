"""Phi-3 and Phi-4 (Phi3ForCausalLM): Llama whose checkpoints store q/k/v and gate/up fused,
as Baton keeps them; its tensors load whole into the fused weights."""
from __future__ import annotations

import torch

from engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def checkpoint_names(self) -> list[str]:
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not self.config.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(self.config.num_layers):
            names += [f"model.layers.{i}.{name}.weight" for name in (
                "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj", "input_layernorm",
                "post_attention_layernorm")]
        return names

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".")
        if len(parts) == 6 and parts[4] in ("qkv_proj", "gate_up_proj"):
            layer = self.layers[int(parts[2])]
            return (layer.attn.qkv_weight if parts[4] == "qkv_proj" else layer.mlp.gate_up_weight).data
        return super()._target(name)
