"""MPT (MptForCausalLM: MPT-7B, 30B): ALiBi for positions (MPT's slopes), q, k and v fused one after another (`Wqkv`)
and clipped to ±`clip_qkv` where it says, layer norms without biases (zeros here, as nothing is read for them), an
ungated exact-GELU MLP, no biases anywhere; its LM head the embeddings."""
from __future__ import annotations

import torch
from torch import nn

from engine.model_config import ModelConfig
from engine.models.layer_norm_llama import Jais2ForCausalLM, LayerNormDecoderLayer
from engine.models.llama_layers import Attention
from engine.models.olmo import ClippedQkvAttention
from kernels.registry import Kernels

MPT_RENAMED = (("transformer.wte.", "model.embed_tokens."), ("transformer.norm_f.", "model.norm."),
               ("transformer.blocks.", "model.layers."), (".norm_1.", ".input_layernorm."),
               (".norm_2.", ".post_attention_layernorm."), (".attn.Wqkv.", ".self_attn.qkv_proj."),
               (".attn.out_proj.", ".self_attn.o_proj."), (".ffn.", ".mlp."))


class MptForCausalLM(Jais2ForCausalLM):
    renames = MPT_RENAMED

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__(config, kernels, dtype, max_positions)
        with torch.no_grad():
            for bias in (self.norm_bias, *(b for layer in self.layers
                                           for b in (layer.input_norm_bias, layer.post_attention_norm_bias))):
                bias.zero_()

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        attention = ClippedQkvAttention if self.config.clip_qkv is not None else Attention
        return LayerNormDecoderLayer(self.config, self.kernels, dtype, self._window(layer), attention=attention)

    def checkpoint_names(self) -> list[str]:
        return [name for name in super().checkpoint_names() if not name.endswith("norm.bias")]

    def _attention_names(self, layer: int) -> list[str]:
        return [f"model.layers.{layer}.self_attn.{proj}.weight" for proj in ("qkv_proj", "o_proj")]

    def _target(self, name: str) -> torch.Tensor:
        if name.endswith(".self_attn.qkv_proj.weight"):  # q's rows, k's, v's: as Baton fuses them
            return self.layers[int(name.split(".")[2])].attn.qkv_weight.data
        return super()._target(name)
