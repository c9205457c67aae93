"""IBM Granite (GraniteForCausalLM, Granite 3): Llama with four scalings of its own, read into
ModelConfig: embeddings times `embedding_multiplier`, each block's output times
`residual_multiplier` before it joins the residual, q·k scaled by `attention_multiplier` (its
attention_scale), logits divided by `logits_scaling`."""
from __future__ import annotations

import torch
from torch import nn

from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_layers import DecoderLayer
from kernels.registry import Kernels


class GraniteDecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, sliding_window: int | None) -> None:
        super().__init__(config, kernels, dtype, sliding_window)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, h, cos, sin, kv_cache, meta):
        scale = self.residual_multiplier
        h = h + self.attn(self.rms_norm(h, self.input_norm, self.eps), cos, sin, kv_cache, meta) * scale
        return h + self.mlp(self.rms_norm(h, self.post_attention_norm, self.eps)) * scale


class GraniteForCausalLM(LlamaForCausalLM):
    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        return GraniteDecoderLayer(self.config, self.kernels, dtype, self._window(layer))

    def _scaled_inputs(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.config.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.config.logits_scaling
