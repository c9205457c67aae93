"""DeepSeek-V3 (DeepseekV3ForCausalLM; R1, V3.1, Kimi K2 share it) and DeepSeek-V2
(DeepseekV2ForCausalLM: V2, V2-Lite, V2.5): multi-head latent attention (engine/models/mla.py),
dense MLPs in the first layers and experts after them beside shared experts, routed as
engine/moe_config.py reads (V3 as GLM-4.5: sigmoid scores within groups; V2 by softmax); V3's
multi-token-prediction layers left unread."""
from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from engine.lora import Target
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_layers import DecoderLayer
from engine.models.mla import MLAttention


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


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    has_mtp_layers = False
