"""Phi-3 and Phi-4 (Phi3ForCausalLM): Llama whose checkpoints store q/k/v and gate/up fused,
as Baton keeps them; its tensors load whole into the fused weights."""
from __future__ import annotations

import torch

from engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def _attention_names(self, layer: int) -> list[str]:
        return [f"model.layers.{layer}.self_attn.{x}.weight" for x in ("qkv_proj", "o_proj")]

    def _mlp_names(self, layer: int) -> list[str]:
        return [f"model.layers.{layer}.mlp.{x}.weight" for x in ("gate_up_proj", "down_proj")]

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".")
        if len(parts) == 6 and parts[4] in ("qkv_proj", "gate_up_proj"):
            layer = self.layers[int(parts[2])]
            return (layer.attn.qkv_weight if parts[4] == "qkv_proj" else layer.mlp.gate_up_weight).data
        return super()._target(name)
