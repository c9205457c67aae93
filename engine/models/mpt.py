"""MPT (MptForCausalLM: MPT-7B, 30B): ALiBi for positions (MPT's slopes), q, k and v fused one after another (`Wqkv`)
and clipped to ±`clip_qkv` where it says, layer norms without biases (zeros here, as nothing is read for them), an
ungated exact-GELU MLP, no biases anywhere; its LM head the embeddings.

DBRX (DbrxForCausalLM: engine/dbrx_config.py) has MPT's layers with RoPE for positions, GQA, and experts in place of
the MLP (softmax over all, the top-k renormalized), each layer's experts stacked a projection at a time (`w1` gate,
`v1` up, `w2` down, [E * width, hidden] each)."""
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
        return LayerNormDecoderLayer(self.config, self.kernels, dtype, self._window(layer), self._is_sparse(layer),
                                     attention=attention)

    def checkpoint_names(self) -> list[str]:
        return [name for name in super().checkpoint_names() if not name.endswith("norm.bias")]

    def _attention_names(self, layer: int) -> list[str]:
        return [f"model.layers.{layer}.self_attn.{proj}.weight" for proj in ("qkv_proj", "o_proj")]

    def _target(self, name: str) -> torch.Tensor:
        if name.endswith(".self_attn.qkv_proj.weight"):  # q's rows, k's, v's: as Baton fuses them
            return self.layers[int(name.split(".")[2])].attn.qkv_weight.data
        return super()._target(name)


DBRX_RENAMED = (("transformer.wte.", "model.embed_tokens."), ("transformer.norm_f.", "model.norm."),
                ("transformer.blocks.", "model.layers."), (".norm_attn_norm.norm_1.", ".input_layernorm."),
                (".norm_attn_norm.norm_2.", ".post_attention_layernorm."),
                (".norm_attn_norm.attn.Wqkv.", ".self_attn.qkv_proj."),
                (".norm_attn_norm.attn.out_proj.", ".self_attn.o_proj."), (".ffn.router.layer.", ".mlp.gate."),
                (".ffn.experts.mlp.", ".mlp.experts."))
STACKED_EXPERTS = ("w1", "v1", "w2")  # gate, up, down


class DbrxForCausalLM(MptForCausalLM):
    renames = DBRX_RENAMED

    def _mlp_names(self, layer: int) -> list[str]:
        p = f"model.layers.{layer}.mlp."
        return [p + "gate.weight", *(p + f"experts.{proj}" for proj in STACKED_EXPERTS)]

    def _placed(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        proj = name.rpartition(".")[2]
        if ".mlp.experts." not in name or proj not in STACKED_EXPERTS:
            return super()._placed(name, tensor)
        mlp, inter = self.layers[int(name.split(".")[2])].mlp, self.config.moe.moe_intermediate_size
        experts = tensor.view(self.config.moe.num_experts, inter, -1)  # [E, width, hidden]
        if proj == "w2":
            return mlp.down_weight.data, experts.transpose(1, 2)
        return (mlp.gate_up_weight.data[:, :inter] if proj == "w1" else mlp.gate_up_weight.data[:, inter:]), experts
