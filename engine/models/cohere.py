"""Cohere's Command R and R+ (CohereForCausalLM) and Command R7B and A (Cohere2ForCausalLM) over paged KV.

- Each layer computes attention and the MLP side by side from one normed input, both added to the residual.
- Its norms are layer norms without a bias (mean-centred, then scaled), in float32.
- RoPE's pairs lie side by side in q and k (ModelConfig.rope_interleaved: reordered as they load); Command R+
  normalizes each head's q and k by a layer norm of its own weights before it (qk_norm "head_layer_norm").
- Command R7B's and A's full-attention layers turn nothing by RoPE (ModelConfig.rope_layers: its sliding-window
  layers only).
- Logits are scaled by `logit_scale`.
- Command A MoE (Cohere2MoeForCausalLM): a dense prefix then experts beside shared ones (engine/models/moe.py), its
  norms RMS norms where its config says.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM, rope_order
from engine.models.llama_layers import MLP, Attention
from engine.models.moe import SparseMoE
from engine.models.parameters import empty_param
from kernels.registry import Kernels


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] normed over D without a bias, in float32, weighed by `weight` (broadcast over x's leading dims)."""
    normed = F.layer_norm(x.float(), (x.shape[-1],), eps=eps)
    return (normed * weight.float()).to(x.dtype)


class CohereAttention(Attention):
    def _projection_norms(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Command R+'s: each head's q and k layer-normed with weights of its own ([heads * head_dim], as loaded).
        cfg, num_tokens = self.config, q.shape[0]
        q = layer_norm(q.view(num_tokens, -1, cfg.head_dim), self.q_norm.view(-1, cfg.head_dim), cfg.rms_norm_eps)
        k = layer_norm(k.view(num_tokens, -1, cfg.head_dim), self.k_norm.view(-1, cfg.head_dim), cfg.rms_norm_eps)
        return q.flatten(1), k.flatten(1)


class CohereDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, sliding_window: int | None,
                 is_sparse: bool = False) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.input_norm = empty_param(config.hidden_size, dtype=dtype)
        self.attn = CohereAttention(config, kernels, dtype, sliding_window)
        self.mlp = SparseMoE(config, kernels, dtype) if is_sparse else MLP(config, kernels, dtype)
        rms_norms = config.cohere2_moe is not None and config.cohere2_moe.rms_norms
        self.norm = partial(kernels.rms_norm, eps=self.eps) if rms_norms else partial(layer_norm, eps=self.eps)

    def forward(self, h, cos, sin, kv_cache, meta):
        x = self.norm(h, self.input_norm)
        return h + self.attn(x, cos, sin, kv_cache, meta) + self.mlp(x)


class CohereForCausalLM(LlamaForCausalLM):
    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        return CohereDecoderLayer(self.config, self.kernels, dtype, self._window(layer), self._is_sparse(layer))

    def _final_norm(self, h: torch.Tensor) -> torch.Tensor:
        if self.config.cohere2_moe is not None and self.config.cohere2_moe.rms_norms:
            return self.kernels.rms_norm(h, self.norm, self.config.rms_norm_eps)
        return layer_norm(h, self.norm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.config.logit_scale

    def _norm_names(self) -> tuple[str, ...]:
        return ("input_layernorm",)

    def _placed(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):  # [heads, head_dim]
            order = rope_order(self.config.head_dim, self.config.rotary_dim)
            return self._target(name), tensor[:, order].reshape(-1)
        return super()._placed(name, tensor)
