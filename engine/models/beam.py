"""Reflection's Beam (BeamForCausalLM; engine/beam_config.py): Qwen3-MoE's attention, q and k normed a head, each
head's output weighed element by element by the sigmoid of a projection of the layer's input plus a bias a head; RoPE
in its sliding-window layers alone, its full layers' q scaled by position instead. Four norms a layer (before and after
attention and the MLP), each block's output joining the residual weighed by the depth of that join: the n-th of the
model's, out / sqrt(n) + residual * sqrt((n - 1) / n). Logits soft-capped.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_layers import DecoderLayer, ElementGatedAttention
from engine.models.parameters import empty_param
from kernels.registry import Kernels

# Its checkpoints' names against Baton's gated attention's.
RENAMED = ((".self_attn.gate_proj.", ".self_attn.g_proj."),)
FEEDFORWARD_NORMS = {"pre_feedforward_layernorm": "pre_feedforward_norm",
                     "post_feedforward_layernorm": "post_feedforward_norm"}


class HeadBiasedGatedAttention(ElementGatedAttention):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, sliding_window: int | None) -> None:
        super().__init__(config, kernels, dtype, sliding_window)
        self.g_bias = empty_param(config.num_heads, dtype=dtype)

    def _gate(self, projected: torch.Tensor) -> torch.Tensor:
        heads = projected.view(projected.shape[0], self.config.num_heads, -1)
        return torch.sigmoid(heads + self.g_bias[:, None]).view_as(projected)


def depth_weighed(out: torch.Tensor, residual: torch.Tensor, join: int) -> torch.Tensor:
    return out * (1.0 / math.sqrt(join)) + residual * math.sqrt((join - 1) / join)


class DepthWeighedLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, sliding_window: int | None,
                 is_sparse: bool, layer: int) -> None:
        super().__init__(config, kernels, dtype, sliding_window, is_sparse, attention=HeadBiasedGatedAttention)
        self.pre_feedforward_norm = empty_param(config.hidden_size, dtype=dtype)
        self.post_feedforward_norm = empty_param(config.hidden_size, dtype=dtype)
        self.attention_join = 2 * (layer + 1)  # (the MLP's the next)

    def forward(self, h, cos, sin, kv_cache, meta):
        norm, eps = self.rms_norm, self.eps
        attended = norm(self.attn(norm(h, self.input_norm, eps), cos, sin, kv_cache, meta), self.post_attention_norm,
                        eps)
        h = depth_weighed(attended, h, self.attention_join)
        out = norm(self.mlp(norm(h, self.pre_feedforward_norm, eps)), self.post_feedforward_norm, eps)
        return depth_weighed(out, h, self.attention_join + 1)


class BeamForCausalLM(LlamaForCausalLM):
    renames = RENAMED

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        return DepthWeighedLayer(self._layer_config(layer), self.kernels, dtype, self._window(layer),
                                 self._is_sparse(layer), layer)

    def _layer_config(self, layer: int) -> ModelConfig:
        """Its full layers' q scaled by position (ModelConfig.q_temperature, for those layers), the others' not."""
        config, temperature = super()._layer_config(layer), self.config.q_temperature
        if temperature is None:
            return config
        applies = layer in temperature.layers
        return dataclasses.replace(config, q_temperature=dataclasses.replace(temperature, layers=None) if applies
                                   else None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits, cap = super().compute_logits(hidden), self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _norm_names(self) -> tuple[str, ...]:
        return (*super()._norm_names(), *FEEDFORWARD_NORMS)

    def _attention_names(self, layer: int) -> list[str]:
        p = f"model.layers.{layer}.self_attn."
        return [*super()._attention_names(layer), p + "g_proj.weight", p + "gate_bias"]

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".")
        if len(parts) == 5 and parts[3] in FEEDFORWARD_NORMS:
            return getattr(self.layers[int(parts[2])], FEEDFORWARD_NORMS[parts[3]]).data
        if name.endswith(".self_attn.gate_bias"):
            return self.layers[int(parts[2])].attn.g_bias.data
        return super()._target(name)
