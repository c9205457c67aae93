"""OLMo (OlmoForCausalLM: OLMo 1B, 7B and their 0424/0724 releases): Llama's layers with layer norms that have neither
weights nor biases (ones and zeros here, as nothing is read for them), and q, k and v clamped to ±`clip_qkv` as they
are projected where config.json gives it."""
from __future__ import annotations

import torch
from torch import nn

from engine.model_config import ModelConfig
from engine.models.layer_norm_llama import Jais2ForCausalLM, LayerNormDecoderLayer
from engine.models.llama_layers import Attention
from kernels.registry import Kernels


class ClippedQkvAttention(Attention):
    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        limit = self.config.clip_qkv
        q, k, v = super()._qkv(x)
        return q.clamp(-limit, limit), k.clamp(-limit, limit), v.clamp(-limit, limit)


class OlmoForCausalLM(Jais2ForCausalLM):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__(config, kernels, dtype, max_positions)
        with torch.no_grad():
            for layer in self.layers:
                for weight, bias in ((layer.input_norm, layer.input_norm_bias),
                                     (layer.post_attention_norm, layer.post_attention_norm_bias)):
                    weight.fill_(1.0)
                    bias.zero_()
            self.norm.fill_(1.0)
            self.norm_bias.zero_()

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        attention = ClippedQkvAttention if self.config.clip_qkv is not None else Attention
        return LayerNormDecoderLayer(self.config, self.kernels, dtype, self._window(layer), attention=attention)

    def checkpoint_names(self) -> list[str]:
        return [name for name in super().checkpoint_names() if not name.endswith(("norm.weight", "norm.bias"))]
