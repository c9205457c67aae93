"""OLMo 2 (Olmo2ForCausalLM; FlexOlmo's, its MLPs OLMoE's experts): Llama with its norms moved. Each block's
output is normed before it joins the residual (post_attention_layernorm, post_feedforward_layernorm), its input is
not; q and k are RMS-normed over their whole projections before RoPE (Attention does, as ModelConfig's
qk_norm "projection" says)."""
from __future__ import annotations

import torch
from torch import nn

from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_layers import MLP, Attention
from engine.models.moe import SparseMoE
from engine.models.parameters import empty_param
from kernels.registry import Kernels


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, sliding_window: int | None,
                 is_sparse: bool = False) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.rms_norm = kernels.rms_norm
        self.post_attention_norm = empty_param(config.hidden_size, dtype=dtype)
        self.post_feedforward_norm = empty_param(config.hidden_size, dtype=dtype)
        self.attn = Attention(config, kernels, dtype, sliding_window)
        self.mlp = SparseMoE(config, kernels, dtype) if is_sparse else MLP(config, kernels, dtype)

    def forward(self, h, cos, sin, kv_cache, meta):
        h = h + self.rms_norm(self.attn(h, cos, sin, kv_cache, meta), self.post_attention_norm, self.eps)
        return h + self.rms_norm(self.mlp(h), self.post_feedforward_norm, self.eps)


class Olmo2ForCausalLM(LlamaForCausalLM):
    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        return Olmo2DecoderLayer(self.config, self.kernels, dtype, self._window(layer), self._is_sparse(layer))

    def _norm_names(self) -> tuple[str, ...]:
        return "post_attention_layernorm", "post_feedforward_layernorm"

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".")
        if len(parts) > 3 and parts[3] == "post_feedforward_layernorm":
            return self.layers[int(parts[2])].post_feedforward_norm.data
        return super()._target(name)
