"""Arcee's Trinity (AfmoeForCausalLM) over paged KV:

- Gemma 3's four norms a layer, before and after attention and the MLP (plain RMS norms here);
- each element of attention's output weighed by the sigmoid of a projection of the layer's input (`gate_proj`);
- q and k normed per head; RoPE in the sliding-window layers alone, the full ones NoPE (ModelConfig.rope_layers);
- after its first dense layers, experts chosen by sigmoid score plus a learnt bias (`expert_bias`), weighed by the
  score renormalized and scaled by `route_scale`, beside shared experts (its MoEConfig);
- with `mup_enabled`, embeddings times sqrt(hidden_size) (ModelConfig.embedding_multiplier).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.models.gemma3 import Gemma3DecoderLayer
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_layers import ElementGatedAttention

# Its MoE's router and bias against Llama's names of them.
ROUTER_NAMES = {"mlp.gate.weight": "mlp.router.gate.weight", "mlp.gate.e_score_correction_bias": "mlp.expert_bias"}


class AfmoeForCausalLM(LlamaForCausalLM):
    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        return Gemma3DecoderLayer(self.config, self.kernels, dtype, self._window(layer), ElementGatedAttention,
                                  self._is_sparse(layer))

    def _scaled_inputs(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        scale = self.config.embedding_multiplier
        return h if scale == 1.0 else h * scale

    def _norm_names(self) -> tuple[str, ...]:
        return "input_layernorm", "post_attention_layernorm", "pre_mlp_layernorm", "post_mlp_layernorm"

    def _attention_names(self, layer: int) -> list[str]:
        return [*super()._attention_names(layer), f"model.layers.{layer}.self_attn.gate_proj.weight"]

    def _mlp_names(self, layer: int) -> list[str]:
        prefix = f"model.layers.{layer}."
        return [prefix + ROUTER_NAMES.get(name.removeprefix(prefix), name.removeprefix(prefix))
                for name in super()._mlp_names(layer)]

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"]:
            return super()._target(name)
        layer, leaf = self.layers[int(parts[2])], ".".join(parts[3:])
        if leaf == "pre_mlp_layernorm.weight":
            return layer.pre_feedforward_norm.data
        if leaf == "post_mlp_layernorm.weight":
            return layer.post_feedforward_norm.data
        if leaf == "self_attn.gate_proj.weight":
            return layer.attn.g_weight.data
        if leaf == "mlp.router.gate.weight":
            return layer.mlp.router_weight.data
        if leaf == "mlp.expert_bias":
            return layer.mlp.router_bias.data
        return super()._target(name)
