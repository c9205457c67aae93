"""MiniCPM3 (MiniCPM3ForCausalLM: openbmb's MiniCPM3-4B): DeepSeek-V2's latent attention (engine/models/mla.py),
RoPE's pairs half apart, before dense MLPs, with MiniCPM's scalings, read into ModelConfig as Granite's: embeddings
times `scale_emb`, each block's output times `scale_depth / sqrt(num_hidden_layers)`, logits divided by
`hidden_size / dim_model_base`."""
from __future__ import annotations

import torch
from torch import nn

from engine.model_config import ModelConfig
from engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from engine.models.granite import GraniteDecoderLayer
from engine.models.llama_layers import DecoderLayer
from engine.models.mla import MLAttention
from kernels.registry import Kernels


class MiniCPM3DecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype) -> None:
        super().__init__(config, kernels, dtype, attention=MLAttention)
        self.residual_multiplier = config.residual_multiplier

    forward = GraniteDecoderLayer.forward  # each block's output scaled before it joins the residual


class MiniCPM3ForCausalLM(DeepseekV3ForCausalLM):
    has_mtp_layers = False

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        return MiniCPM3DecoderLayer(self.config, self.kernels, dtype)

    def _scaled_inputs(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return h * self.config.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.config.logits_scaling
