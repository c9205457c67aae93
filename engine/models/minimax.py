"""MiniMax-Text-01 and MiniMax-M1 (MiniMaxForCausalLM; engine/minimax_config.py): lightning attention layers between
Llama's attention layers, Mixtral's experts in every layer.

A lightning layer projects q, k and v at once through SiLU, runs linear attention with a decay a head
(kernels/lightning_attention.py: its slope falls geometrically with the head, and linearly with the layer's depth),
RMS-norms the heads' outputs together, gates them by the sigmoid of a projection of the layer's input and projects
them back. Each block, either kind of attention or the experts, reads its normed input, and the residual it adds to
is that normed input, weighed: h = alpha * norm(h) + beta * block(norm(h)).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.model_config import ModelConfig
from engine.models.hybrid import HybridForward
from engine.models.llama_layers import Attention, DecoderLayer
from engine.models.parameters import empty_param
from kernels import lightning_attention as lightning
from kernels.registry import Kernels

# A lightning layer's tensors as checkpoints name them (under `self_attn.`), by its attributes.
TENSORS = {"qkv_proj.weight": "qkv_weight", "output_gate.weight": "gate_weight", "norm.weight": "norm",
           "out_proj.weight": "out_weight"}
# What transformers keeps beside them, made from the config here.
DECAY_BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")


def slopes(num_heads: int, layer: int, num_layers: int) -> torch.Tensor:
    """A lightning layer's decay rate a head: (2^(-8/H))^(h+1), scaled down with the layer's depth."""
    depth = 1 - layer / (num_layers - 1 + 1e-5) + 1e-5
    return (1 / 2 ** (8 / num_heads)) ** torch.arange(1, num_heads + 1, dtype=torch.float32) * depth


class LightningAttention(nn.Module):
    """`index`: its place among the model's lightning layers (its states'). Called as any attention layer is
    (positions and pages unread)."""

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, sliding_window: int | None,
                 layer: int, index: int) -> None:
        super().__init__()
        self.linear, self.eps, self.index = kernels.linear, config.rms_norm_eps, index
        self.layout = m = config.minimax
        width = m.num_heads * m.head_dim
        self.qkv_weight = empty_param(3 * width, config.hidden_size, dtype=dtype)  # a head's q, k and v in turn
        self.gate_weight = empty_param(width, config.hidden_size, dtype=dtype)
        self.norm = empty_param(width, dtype=dtype)
        self.out_weight = empty_param(config.hidden_size, width, dtype=dtype)
        self.register_buffer("slopes", slopes(m.num_heads, layer, config.num_layers), persistent=False)

    def forward(self, x: torch.Tensor, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        m, batch, num_tokens = self.layout, meta.recurrent, x.shape[0]
        _, states = batch.layer(self.index)
        qkv = F.silu(self.linear(x, self.qkv_weight)).float().view(num_tokens, m.num_heads, 3 * m.head_dim)
        q, k, v = qkv.split(m.head_dim, dim=-1)
        out = torch.empty(q.shape, dtype=torch.float32, device=x.device)
        batch.advance(out, states, lambda row: batch.kept_layer(row, self.index)[1],
                      lambda tokens, before: lightning.step(q[tokens], k[tokens], v[tokens], self.slopes, before),
                      lambda start, end, state: lightning.run(q[start:end], k[start:end], v[start:end], self.slopes,
                                                              state, m.block_size))
        normed = F.rms_norm(out.to(x.dtype).view(num_tokens, -1), (out.shape[1] * out.shape[2],), self.norm,
                            eps=self.eps)
        return self.linear(torch.sigmoid(self.linear(x, self.gate_weight)) * normed, self.out_weight)


class NormedResidualLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, layer: int,
                 sliding_window: int | None) -> None:
        m = config.minimax
        is_linear = layer in m.linear_layers
        attention = functools.partial(LightningAttention, layer=layer, index=m.linear_layers.index(layer)) \
            if is_linear else Attention
        super().__init__(config, kernels, dtype, sliding_window, is_sparse=True, attention=attention)
        self.attn_factors = m.linear_factors if is_linear else m.full_factors
        self.mlp_factors = m.mlp_factors

    def forward(self, h, cos, sin, kv_cache, meta):
        (attn_alpha, attn_beta), (mlp_alpha, mlp_beta) = self.attn_factors, self.mlp_factors
        h = self.rms_norm(h, self.input_norm, self.eps)
        h = h * attn_alpha + self.attn(h, cos, sin, kv_cache, meta) * attn_beta
        h = self.rms_norm(h, self.post_attention_norm, self.eps)
        return h * mlp_alpha + self.mlp(h) * mlp_beta


class MiniMaxForCausalLM(HybridForward):
    serves_loras = False  # (its lightning layers not yet checked with adapters)

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        return NormedResidualLayer(self.config, self.kernels, dtype, layer, self._window(layer))

    def _attention_names(self, layer: int) -> list[str]:
        if layer not in self.config.minimax.linear_layers:
            return super()._attention_names(layer)
        return [f"model.layers.{layer}.self_attn.{name}" for name in TENSORS]

    def is_unused_tensor(self, name: str) -> bool:
        return name.endswith(tuple(f"self_attn.{buffer}" for buffer in DECAY_BUFFERS)) or \
            super().is_unused_tensor(name)

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".")
        if len(parts) > 4 and parts[3] == "self_attn" and int(parts[2]) in self.config.minimax.linear_layers:
            return getattr(self.layers[int(parts[2])].attn, TENSORS[".".join(parts[4:])]).data
        return super()._target(name)
