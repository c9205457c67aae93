"""GLM-4 (GlmForCausalLM: glm-4-9b-chat-hf) and GLM-4-0414 (Glm4ForCausalLM: GLM-4-9B/32B-0414, GLM-Z1): Llama
whose checkpoints store gate and up fused (`mlp.gate_up_proj`), with biases on q, k and v, RoPE over part of each
head with its pairs side by side (ModelConfig.rope_interleaved); GLM-4-0414's layers norm the attention's and the
MLP's outputs too, as Gemma's do (`post_self_attn_layernorm`, `post_mlp_layernorm`; its `post_attention_layernorm`
norms the MLP's input). Kolibri-1 (Kolibri1ForCausalLM: engine/kolibri1_config.py) has GLM-4-0414's layers around
EXAONE 4's attention and experts in every layer, its MLP's names Llama's."""
from __future__ import annotations

import torch
from torch import nn

from engine.models.gemma3 import Gemma3DecoderLayer
from engine.models.llama import LlamaForCausalLM

# GLM-4-0414's norms, as its checkpoints name them, by the sandwich layer's names.
SANDWICH_NORMS = {"input_layernorm": "input_norm", "post_self_attn_layernorm": "post_attention_norm",
                  "post_attention_layernorm": "pre_feedforward_norm", "post_mlp_layernorm": "post_feedforward_norm"}


class GlmForCausalLM(LlamaForCausalLM):
    def _mlp_names(self, layer: int) -> list[str]:
        return [f"model.layers.{layer}.mlp.{x}.weight" for x in ("gate_up_proj", "down_proj")]

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".")
        if len(parts) == 6 and parts[4] == "gate_up_proj":
            return self.layers[int(parts[2])].mlp.gate_up_weight.data
        return super()._target(name)


class SandwichNormLayers(LlamaForCausalLM):
    """Layers of GLM-4-0414's norms: attention and the MLP each between two (Gemma3DecoderLayer)."""

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        return Gemma3DecoderLayer(self.config, self.kernels, dtype, self._window(layer),
                                  is_sparse=self._is_sparse(layer))

    def _norm_names(self) -> tuple[str, ...]:
        return tuple(SANDWICH_NORMS)

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".")
        if len(parts) > 3 and parts[1] == "layers" and parts[3] in SANDWICH_NORMS:
            return getattr(self.layers[int(parts[2])], SANDWICH_NORMS[parts[3]]).data
        return super()._target(name)


class Glm4ForCausalLM(SandwichNormLayers, GlmForCausalLM):
    pass


# Kolibri-1's names as released against transformers'.
KOLIBRI1_RENAMED = ((".moe.router.expert_bias", ".mlp.gate.e_score_correction_bias"),
                    (".post_attn_norm.", ".post_self_attn_layernorm."), (".post_ffn_norm.", ".post_mlp_layernorm."))


class Kolibri1ForCausalLM(SandwichNormLayers):
    renames = KOLIBRI1_RENAMED
