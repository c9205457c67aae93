"""Gemma 2's and Gemma 3's text decoders (Gemma2ForCausalLM, Gemma3ForCausalLM) over paged KV:
Llama's attention and MLP, arranged and scaled Gemma's way. Gemma 1's (GemmaForCausalLM) are Llama's layers, two
norms each, its norms and embeddings scaled as here; VaultGemma's too, with Gemma 2's attention.

- Four norms a layer: after attention and after the MLP as well as before each.
- Norms scale by 1 + weight: the 1 is added as the weights load (in float32, as transformers
  adds it), so they run as Llama's do.
- Embeddings are multiplied by sqrt(hidden_size); the tied LM head uses them unscaled.
- Gemma 3's sliding-window layers have a RoPE of their own (unscaled, its own theta); the others,
  and all of Gemma 2's, the model's.
- Gemma 2 soft-caps attention scores (in the attention kernels) and the final logits (here).
- q·k is scaled by query_pre_attn_scalar ** -0.5 and the MLP gate is GELU (tanh), both read
  into ModelConfig.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_layers import MLP, Attention, DecoderLayer
from engine.models.moe import SparseMoE
from engine.models.parameters import empty_param
from kernels.registry import Kernels


class Gemma3DecoderLayer(nn.Module):
    """Attention and the MLP each between two norms, the residual around each (Trinity's layers too, with their own
    `attention` and experts)."""

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, sliding_window: int | None,
                 attention: type[Attention] = Attention, is_sparse: bool = False) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.rms_norm = kernels.rms_norm
        self.input_norm = empty_param(config.hidden_size, dtype=dtype)
        self.post_attention_norm = empty_param(config.hidden_size, dtype=dtype)
        self.pre_feedforward_norm = empty_param(config.hidden_size, dtype=dtype)
        self.post_feedforward_norm = empty_param(config.hidden_size, dtype=dtype)
        self.attn = attention(config, kernels, dtype, sliding_window)
        self.mlp = SparseMoE(config, kernels, dtype) if is_sparse else MLP(config, kernels, dtype)

    def forward(self, h, cos, sin, kv_cache, meta):
        norm, eps = self.rms_norm, self.eps
        attended = self.attn(norm(h, self.input_norm, eps), cos, sin, kv_cache, meta)
        h = h + norm(attended, self.post_attention_norm, eps)
        return h + norm(self.mlp(norm(h, self.pre_feedforward_norm, eps)), self.post_feedforward_norm, eps)


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__(config, kernels, dtype, max_positions)
        self.embed_scale = config.hidden_size**0.5
        self.final_softcap = config.final_logit_softcapping

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        return Gemma3DecoderLayer(self.config, self.kernels, dtype, self._window(layer))

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embedded = super()._embed(input_ids)
        return embedded * torch.tensor(self.embed_scale, dtype=embedded.dtype)  # rounded to the dtype, as transformers

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap

    def _norm_names(self) -> tuple[str, ...]:
        return (*super()._norm_names(), "pre_feedforward_layernorm", "post_feedforward_layernorm")

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((name, tensor.float() + 1.0 if name.endswith("norm.weight") else tensor)
                             for name, tensor in tensors)

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".")
        if len(parts) > 3 and parts[3] in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            layer = self.layers[int(parts[2])]
            return (layer.pre_feedforward_norm if parts[3] == "pre_feedforward_layernorm"
                    else layer.post_feedforward_norm).data
        return super()._target(name)


class GemmaForCausalLM(Gemma3ForCausalLM):
    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        return DecoderLayer(self.config, self.kernels, dtype, self._window(layer))

    def _norm_names(self) -> tuple[str, ...]:
        return LlamaForCausalLM._norm_names(self)


class VaultGemmaForCausalLM(GemmaForCausalLM):
    """Gemma 2's attention (soft caps, every other layer windowed) in Gemma 1's layers of two norms, the second named
    as Gemma 2's norm before the MLP."""

    def _norm_names(self) -> tuple[str, ...]:
        return "input_layernorm", "pre_feedforward_layernorm"

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".")
        if len(parts) > 3 and parts[3] == "pre_feedforward_layernorm":
            return self.layers[int(parts[2])].post_attention_norm.data
        return super()._target(name)
