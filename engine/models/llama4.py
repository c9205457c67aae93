"""Llama 4 (Llama4ForCausalLM; the text model of Llama4ForConditionalGeneration, as Scout and Maverick
are released: engine/multimodal.py), as `transformers` computes it, images aside:

- RoPE layers attend within chunks of `attention_chunk_size` positions, their q and k L2-normed
  (no weight) after RoPE; every `no_rope_layer_interval`-th layer has no RoPE, attends to the whole
  sequence and scales q by its position's attention temperature, log(floor((p + 1) / floor_scale) + 1)
  * attn_scale + 1;
- RoPE pairs each dimension with its neighbour (complex rotation): the q and k weights' rows are
  reordered as they load so that the usual pairing, half a head apart, is the same rotation;
- MoE layers (every `interleave_moe_layer_step`-th) route each token to its top-k experts by the
  sigmoid of their router logits, which weigh the experts' inputs; one shared expert beside them.
  Experts are stored fused, `gate_up_proj` [E, hidden, 2 inter] and `down_proj` [E, inter, hidden].
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_layers import Attention, DecoderLayer, KVCache, paged_attention, q_temperature
from kernels.registry import Kernels


class Llama4Attention(Attention):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, sliding_window: int | None,
                 layer: int) -> None:
        super().__init__(config, kernels, dtype, sliding_window)
        self.uses_rope = layer in config.rope_layers
        self.is_q_tempered = config.q_temperature is not None and layer in config.q_temperature.layers
        self.chunk_size = config.attention_chunk_size if layer in config.chunked_layers else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        cfg, ops = self.config, self.kernels
        q, k, v = self._qkv(x)
        if self.uses_rope:
            q, k = ops.apply_rope(q, k, cos, sin)
            if cfg.qk_l2_norm:
                q, k = _l2_normed(q, cfg.rms_norm_eps), _l2_normed(k, cfg.rms_norm_eps)
        elif self.is_q_tempered:
            q = q_temperature(q, cfg.q_temperature, meta.positions)
        return self._output(paged_attention(ops, q, k, v, kv_cache, meta, self.scale, None, None, self.chunk_size))


def _l2_normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    # Over each head's dimensions, in float32, without a weight (transformers' Llama4TextL2Norm).
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4ForCausalLM(LlamaForCausalLM):
    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        return DecoderLayer(self.config, self.kernels, dtype, None, self._is_sparse(layer),
                            attention=functools.partial(Llama4Attention, layer=layer))

    def _mlp_names(self, layer: int) -> list[str]:
        p = f"model.layers.{layer}.feed_forward."
        if not self._is_sparse(layer):
            return [p + f"{x}_proj.weight" for x in ("gate", "up", "down")]
        return [p + "router.weight", p + "experts.gate_up_proj", p + "experts.down_proj",
                *(p + f"shared_expert.{x}_proj.weight" for x in ("gate", "up", "down"))]

    def _placed(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        parts = name.split(".")
        if len(parts) > 4 and parts[3] == "feed_forward":
            return self._feed_forward_target(int(parts[2]), ".".join(parts[4:]), tensor)
        return super()._placed(name, tensor)

    def _feed_forward_target(self, layer: int, leaf: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where `feed_forward.<leaf>` of `layer` goes, and the tensor as it goes there."""
        mlp, inter = self.layers[layer].mlp, self.config.intermediate_size
        if not self._is_sparse(layer):
            if leaf == "down_proj.weight":
                return mlp.down_weight.data, tensor
            return (mlp.gate_up_weight.data[:inter] if leaf == "gate_proj.weight"
                    else mlp.gate_up_weight.data[inter:]), tensor
        if leaf == "router.weight":
            return mlp.router_weight.data, tensor
        if leaf in ("experts.gate_up_proj", "experts.down_proj"):  # [E, in, out]: each expert's as nn.Linear's
            target = mlp.gate_up_weight if leaf == "experts.gate_up_proj" else mlp.down_weight
            return target.data, tensor.transpose(1, 2)
        return mlp.shared_slice(leaf.split(".")[1].removesuffix("_proj")), tensor

