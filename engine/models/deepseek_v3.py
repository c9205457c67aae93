"""DeepSeek-V3 (DeepseekV3ForCausalLM; R1, V3.1, Kimi K2 share it) and DeepSeek-V2
(DeepseekV2ForCausalLM: V2, V2-Lite, V2.5): multi-head latent attention (engine/models/mla.py),
dense MLPs in the first layers and experts after them beside shared experts, routed as
engine/moe_config.py reads (V3 as GLM-4.5: sigmoid scores within groups; V2 by softmax); V3's
multi-token-prediction layers left unread. SK Telecom's A.X K1 (AXK1ForCausalLM) is V3 with its experts' output
RMS-normed."""
from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from engine.lora import Target
from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_layers import DecoderLayer
from engine.models.mla import MLAttention
from engine.models.moe import SparseMoE
from engine.models.parameters import empty_param
from kernels.registry import Kernels


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    has_mtp_layers = True

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        shares_choice = layer in self.config.mla.shared_index_layers  # (GLM-5's layers without an indexer)
        return DecoderLayer(self.config, self.kernels, dtype, self._window(layer), self._is_sparse(layer),
                            attention=functools.partial(MLAttention, shares_choice=shares_choice))

    def _attention_names(self, layer: int) -> list[str]:
        return self.layers[layer].attn.checkpoint_names(f"model.layers.{layer}.self_attn.")

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        def the_rest() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in tensors:
                parts = name.split(".")
                if len(parts) > 4 and parts[3] == "self_attn":
                    self.layers[int(parts[2])].attn.load(".".join(parts[4:]), tensor)
                else:
                    yield name, tensor
        super().load_weights(the_rest())

    def lora_target(self, module: str) -> Target | None:
        return None if ".self_attn." in module else super().lora_target(module)


class PostNormedMoE(SparseMoE):
    """Experts whose output is RMS-normed (A.X K1's `post_mlp_layernorm`)."""

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype) -> None:
        super().__init__(config, kernels, dtype)
        self.rms_norm, self.eps = kernels.rms_norm, config.rms_norm_eps
        self.out_norm = empty_param(config.hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rms_norm(super().forward(x), self.out_norm, self.eps)


class AXK1ForCausalLM(DeepseekV3ForCausalLM):
    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        made = super()._make_layer(layer, dtype)
        if self._is_sparse(layer):
            made.mlp = PostNormedMoE(self.config, self.kernels, dtype)
        return made

    def _mlp_names(self, layer: int) -> list[str]:
        names = super()._mlp_names(layer)
        return names + [f"model.layers.{layer}.post_mlp_layernorm.weight"] if self._is_sparse(layer) else names

    def is_unused_tensor(self, name: str) -> bool:
        # its releases hold the norm in the dense layers too, which compute without it
        parts = name.split(".")
        return (len(parts) == 5 and parts[3] == "post_mlp_layernorm" and parts[1] == "layers"
                and not self._is_sparse(int(parts[2]))) or super().is_unused_tensor(name)

    def fill_absent(self, name: str) -> bool:
        if not name.endswith(".mlp.gate.e_score_correction_bias"):
            return super().fill_absent(name)
        self._target(name).zero_()  # its releases route without one
        return True

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".")
        if len(parts) == 5 and parts[3] == "post_mlp_layernorm":
            return self.layers[int(parts[2])].mlp.out_norm.data
        return super()._target(name)


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    has_mtp_layers = False
