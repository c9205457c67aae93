"""Laguna (LagunaForCausalLM; engine/laguna_config.py): Llama's layers with each layer's own q heads, q and k normed a
head, attention's output weighed by the softplus of a projection of the layer's input (a number a head, or one an
element), sliding-window layers with a RoPE of their own, experts routed as GLM-4.5's in one group (the router's
logits soft-capped) beside an ungated shared expert."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.llama import LlamaForCausalLM
from engine.models.llama_layers import DecoderLayer, GatedOutputAttention


class SoftplusGatedAttention(GatedOutputAttention):
    @staticmethod
    def _gate(projected: torch.Tensor) -> torch.Tensor:
        return F.softplus(projected.float()).to(projected.dtype)  # in float32, as transformers computes it


class ElementSoftplusGatedAttention(SoftplusGatedAttention):
    per_element = True


class LagunaForCausalLM(LlamaForCausalLM):
    renames = ((".mlp.experts.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
               (".mlp.shared_expert.", ".mlp.shared_experts."))

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        attention = ElementSoftplusGatedAttention if self.config.laguna.gate_per_element else SoftplusGatedAttention
        return DecoderLayer(self._layer_config(layer), self.kernels, dtype, self._window(layer), self._is_sparse(layer),
                            attention=attention)

    def _attention_names(self, layer: int) -> list[str]:
        return [*super()._attention_names(layer), f"model.layers.{layer}.self_attn.g_proj.weight"]
