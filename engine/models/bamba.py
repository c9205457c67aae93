"""IBM's Bamba (BambaForCausalLM: Bamba-9B v1, v2): Mamba-2 layers (engine/models/mamba2.py, Granite 4.0-H's kind)
between attention layers at `attn_layer_indices`, RoPE over half of each head; a SwiGLU MLP in every layer. Its
attention layers have pages, its Mamba-2 layers keep states (engine/models/hybrid.py). Checkpoint names are read as
Llama's where the layers are."""
from __future__ import annotations

import torch
from torch import nn

from engine.lora import Target
from engine.model_config import ModelConfig
from engine.models.hybrid import HybridForward
from engine.models.llama_layers import MLP
from engine.models.mamba2 import Mamba2Mixer
from engine.models.parameters import empty_param
from engine.weights import renamed
from kernels.registry import Kernels

# Bamba's names and Llama's, each way.
RENAMED = ((".feed_forward.", ".mlp."), (".pre_ff_layernorm.", ".post_attention_layernorm."),
           ("model.final_layernorm.", "model.norm."))


class MambaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, index: int) -> None:
        super().__init__()
        self.eps, self.rms_norm = config.rms_norm_eps, kernels.rms_norm
        self.input_norm = empty_param(config.hidden_size, dtype=dtype)
        self.post_attention_norm = empty_param(config.hidden_size, dtype=dtype)
        self.mamba = Mamba2Mixer(config, kernels, dtype, index)
        self.mlp = MLP(config, kernels, dtype)

    def forward(self, h, cos, sin, kv_cache, meta):
        h = h + self.mamba(self.rms_norm(h, self.input_norm, self.eps), meta)
        return h + self.mlp(self.rms_norm(h, self.post_attention_norm, self.eps))


class BambaForCausalLM(HybridForward):
    """(Jamba's and Falcon-H1's models are built on it: their Mamba layers' tensors under `mamba.`, their names
    Llama's by `renames`.)"""

    renames = RENAMED
    serves_loras = True  # on its attention, its Mamba-2 layers' projections in and out, its MLPs

    @property
    def _mamba_layers(self) -> tuple[int, ...]:
        return self.config.mamba.mamba_layers

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        if layer not in self._mamba_layers:
            return super()._make_layer(layer, dtype)
        return MambaDecoderLayer(self.config, self.kernels, dtype, self._mamba_layers.index(layer))

    def _attention_names(self, layer: int) -> list[str]:
        if layer not in self._mamba_layers:
            return super()._attention_names(layer)
        return [f"model.layers.{layer}.mamba.{name}" for name in self.layers[layer].mamba.tensor_names()]

    def _placed(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if name.endswith(".mamba.conv1d.weight"):  # [C, 1, K]
            tensor = tensor.squeeze(1)
        return super()._placed(name, tensor)

    def lora_target(self, module: str) -> Target | None:
        return super().lora_target(renamed(module + ".", self.renames).removesuffix("."))  # (its MLPs' feed_forward)

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".", 4)
        if len(parts) == 5 and parts[3] == "mamba":
            return self.layers[int(parts[2])].mamba.tensor(parts[4])
        return super()._target(name)
