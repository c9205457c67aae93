"""MiMo-V2-Flash (MiMoV2FlashForCausalLM; engine/mimo_v2_flash_config.py): Llama's layers whose v heads are narrower
than q's and k's, its sliding-window layers with twice the full layers' KV heads and a sink a head, RoPE over part of
each head at a theta a layer type, and DeepSeek-V3's routing without shared experts.

The pages hold a sliding layer's KV heads, `head_dim` wide: a full layer writes and reads every other one of them (every
`ratio`-th, as many as it has), so that a rank's run of the pages' heads holds its share of a full layer's heads too and
split and whole workers' pages are alike; every v head is widened with zeros to `head_dim` in them (attention over
zeros gives zeros, dropped before o_proj)."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_layers import Attention, DecoderLayer
from engine.models.parameters import empty_param
from kernels.registry import Kernels


class NarrowValueAttention(Attention):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, sliding_window: int | None) -> None:
        super().__init__(config, kernels, dtype, sliding_window)
        self.v_head_dim = config.mimo_v2_flash.v_head_dim
        self.v_size = config.num_kv_heads * self.v_head_dim
        self.qkv_weight = empty_param(config.q_size + config.kv_size + self.v_size, config.hidden_size, dtype=dtype)
        self.o_weight = empty_param(config.hidden_size, config.num_heads * self.v_head_dim, dtype=dtype)

    def forward(self, x, cos, sin, kv_cache, meta):
        stride = kv_cache[0].shape[0] // self.config.num_kv_heads  # a full layer's heads: every stride-th of the pages'
        return super().forward(x, cos, sin, (kv_cache[0][::stride], kv_cache[1][::stride]), meta)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg, num_tokens = self.config, x.shape[0]
        qkv = self.kernels.linear(x, self.qkv_weight)
        if self.lora is not None:
            self.lora.add("qkv", x, qkv)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, self.v_size], dim=-1)
        v = F.pad(v.view(num_tokens, cfg.num_kv_heads, self.v_head_dim), (0, cfg.head_dim - self.v_head_dim))
        return q.view(num_tokens, cfg.num_heads, cfg.head_dim), k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim), v

    def _attended(self, out: torch.Tensor) -> torch.Tensor:
        return out[..., :self.v_head_dim].reshape(out.shape[0], -1)


class MiMoV2FlashForCausalLM(LlamaForCausalLM):
    renames = ((".self_attn.attention_sink_bias", ".self_attn.sinks"),)  # as released

    def _layer_config(self, layer: int) -> ModelConfig:
        """A full layer's own KV heads and no sinks; a sliding layer's, all the pages' heads and a sink a head."""
        config = super()._layer_config(layer)
        if layer in self.config.sliding_layers:
            return dataclasses.replace(config, attention_sinks=True)
        return dataclasses.replace(config, num_kv_heads=self.config.mimo_v2_flash.full_kv_heads)

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        return DecoderLayer(self._layer_config(layer), self.kernels, dtype, self._window(layer), self._is_sparse(layer),
                            attention=NarrowValueAttention)

    def _attention_names(self, layer: int) -> list[str]:
        p = f"model.layers.{layer}.self_attn."
        names = [p + f"{x}_proj.weight" for x in "qkvo"]
        return names + [p + "sinks"] if layer in self.config.sliding_layers else names

    def _qkv_rows(self, layer: int) -> dict[str, tuple[int, int]]:
        """Where q's, k's and v's projections lie in layer `layer`'s fused one: its own KV heads, v's narrower."""
        attn = self.layers[layer].attn
        q, kv = attn.config.q_size, attn.config.kv_size
        return {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + kv + attn.v_size)}

    def _placed(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if name.endswith(".self_attn.v_proj.weight"):  # its values scaled, as transformers scales v's projection
            tensor = tensor * self.config.mimo_v2_flash.value_scale
        return super()._placed(name, tensor)

    def lora_matrices(self, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if module.endswith("self_attn.v_proj"):  # inside v's projection, scaled with it
            b = b * self.config.mimo_v2_flash.value_scale
        return super().lora_matrices(module, a, b)
