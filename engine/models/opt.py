"""Meta's OPT (OPTForCausalLM: opt-125m to opt-66b but opt-350m's post-norm layout) over paged KV: Llama's layers with
layer norms that have a bias (engine/models/layer_norm_llama.py), an MLP without a gate (fc1, ReLU, fc2), biases
everywhere by `enable_bias`, and no RoPE: a learnt embedding of each position (offset by 2, as OPT's table keeps two
rows before position 0) is added to the token's before the first layer.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from engine.lora import Target
from engine.model_config import ModelConfig
from engine.models.layer_norm_llama import Jais2ForCausalLM
from engine.models.parameters import empty_param
from engine.weights import renamed
from kernels.registry import Kernels

POSITION_OFFSET = 2  # OPT's table's rows before position 0 (its padding's, in fairseq)
# OPT's names against Llama's (the model's final norm before any layer's: it shares the name's end).
OPT_RENAMED = (("model.decoder.final_layer_norm.", "model.norm."),
               ("model.decoder.embed_tokens.", "model.embed_tokens."),
               ("model.decoder.embed_positions.", "model.embed_positions."), ("model.decoder.layers.", "model.layers."),
               (".self_attn.out_proj.", ".self_attn.o_proj."), (".self_attn_layer_norm.", ".input_layernorm."),
               (".final_layer_norm.", ".post_attention_layernorm."), (".fc1.", ".mlp.up_proj."),
               (".fc2.", ".mlp.down_proj."))


class OPTForCausalLM(Jais2ForCausalLM):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__(config, kernels, dtype, max_positions)
        self.position_embed = empty_param(config.max_position_embeddings + POSITION_OFFSET, config.hidden_size,
                                          dtype=dtype)

    def _scaled_inputs(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return h + F.embedding(positions + POSITION_OFFSET, self.position_embed)

    def checkpoint_names(self) -> list[str]:
        return [renamed(name, OPT_RENAMED, back=True)
                for name in [*super().checkpoint_names(), "model.embed_positions.weight"]]

    def is_unused_tensor(self, name: str) -> bool:
        # Some releases save the LM head beside the embeddings it is tied to.
        return (name == "lm_head.weight" and self.config.tie_word_embeddings) or super().is_unused_tensor(name)

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((renamed(name, OPT_RENAMED), tensor) for name, tensor in tensors)

    def lora_target(self, module: str) -> Target | None:
        return super().lora_target(renamed(module + ".", OPT_RENAMED).removesuffix("."))

    def _target(self, name: str) -> torch.Tensor:
        if name == "model.embed_positions.weight":
            return self.position_embed.data
        return super()._target(name)
