"""DeepSeek-V3 (DeepseekV3ForCausalLM; R1, V3.1, Kimi K2 share it) and DeepSeek-V2
(DeepseekV2ForCausalLM: V2, V2-Lite, V2.5): multi-head latent attention (engine/models/mla.py),
dense MLPs in the first layers and experts after them beside shared experts, routed as
engine/moe_config.py reads (V3 as GLM-4.5: sigmoid scores within groups; V2 by softmax); V3's
multi-token-prediction layers left unread. SK Telecom's A.X K1 (AXK1ForCausalLM) is V3 with its experts' output
RMS-normed; its A.X K2 (AXK2ForCausalLM) V3.2 with gated heads and norms."""
from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
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


class NormGate(nn.Module):
    """A norm's output weighed by the sigmoid of a low-rank MLP of it (A.X K2's: `W_down`, SiLU, `W_up`)."""

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = kernels.linear
        self.down_weight = empty_param(config.gated_norm_rank, config.hidden_size, dtype=dtype)
        self.up_weight = empty_param(config.hidden_size, config.gated_norm_rank, dtype=dtype)

    def forward(self, normed: torch.Tensor) -> torch.Tensor:
        gate = self.linear(F.silu(self.linear(normed, self.down_weight)), self.up_weight)
        return (normed * torch.sigmoid(gate.float())).to(normed.dtype)


class GatedNormLayer(DecoderLayer):
    """A decoder layer whose norm before attention, and before the MLP where `gates_mlp_input`, is gated (NormGate)."""

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, gates_mlp_input: bool,
                 **layer) -> None:
        super().__init__(config, kernels, dtype, **layer)
        self.input_gate = NormGate(config, kernels, dtype)
        self.post_attention_gate = NormGate(config, kernels, dtype) if gates_mlp_input else None

    def forward(self, h, cos, sin, kv_cache, meta):
        h = h + self.attn(self.input_gate(self.rms_norm(h, self.input_norm, self.eps)), cos, sin, kv_cache, meta)
        normed = self.rms_norm(h, self.post_attention_norm, self.eps)
        return h + self.mlp(normed if self.post_attention_gate is None else self.post_attention_gate(normed))


class AXK2ForCausalLM(DeepseekV3ForCausalLM):
    """SK Telecom's A.X K2 (engine/axk2_config.py): DeepSeek-V3.2's model, each head's output gated (MLAConfig.
    output_gate), its norms before attention, and before the experts, gated by a low-rank MLP of their output."""

    renames = ((".input_layernorm.norm.", ".input_layernorm."),
               (".post_attention_layernorm.norm.", ".post_attention_layernorm."))

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        return GatedNormLayer(self.config, self.kernels, dtype, self._is_sparse(layer), sliding_window=None,
                              is_sparse=self._is_sparse(layer), attention=MLAttention)

    def _gate_names(self, layer: int, norm: str) -> list[str]:
        return [f"model.layers.{layer}.{norm}.{weight}.weight" for weight in ("W_down", "W_up")]

    def _attention_names(self, layer: int) -> list[str]:
        return super()._attention_names(layer) + self._gate_names(layer, "input_layernorm")

    def _mlp_names(self, layer: int) -> list[str]:
        names = super()._mlp_names(layer)
        return names + self._gate_names(layer, "post_attention_layernorm") if self._is_sparse(layer) else names

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".")
        if len(parts) == 6 and parts[4] in ("W_down", "W_up"):
            layer = self.layers[int(parts[2])]
            gate = layer.input_gate if parts[3] == "input_layernorm" else layer.post_attention_gate
            return (gate.down_weight if parts[4] == "W_down" else gate.up_weight).data
        return super()._target(name)


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    has_mtp_layers = False
