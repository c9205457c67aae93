"""Models of Mamba layers alone: state-spaces' Mamba (MambaForCausalLM) and TII's Falcon-Mamba (FalconMambaForCausalLM,
its dt, B and C RMS-normed without weights) of Mamba-1 layers (engine/mamba1_config.py, engine/models/jamba.py's
Mixer), Mamba-Codestral (Mamba2ForCausalLM) of Mamba-2 layers (engine/models/mamba2.py). Each layer adds its Mamba
layer's output on its RMS-normed input to the residual; a final norm, the LM head (tied where the config says). Their
checkpoints name the model `backbone.` (read as `model.`: engine/model_runner.py), its embeddings `embeddings`, its
final norm `norm_f`, each layer's mixer `mixer` and its norm `norm`.

The pages hold no layer's KV: the pool's one layer (ModelConfig.num_kv_layers) holds the sequences' states.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.lora import Target
from engine.model_config import ModelConfig
from engine.models.hybrid import HybridForward
from engine.models.jamba import Mamba1Mixer, mamba1_lora_rows
from engine.models.mamba2 import Mamba2Mixer
from engine.models.parameters import empty_param
from kernels.registry import Kernels

RENAMED = (("model.embeddings.", "model.embed_tokens."), ("model.norm_f.", "model.norm."), (".mixer.", ".mamba."))


class MambaLayer(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, layer: int) -> None:
        super().__init__()
        self.rms_norm, self.eps = kernels.rms_norm, config.rms_norm_eps
        self.norm = empty_param(config.hidden_size, dtype=dtype)
        self.mamba = Mamba1Mixer(config, kernels, dtype, layer) if config.mamba1 is not None else \
            Mamba2Mixer(config, kernels, dtype, layer)

    def forward(self, h, cos, sin, kv_cache, meta: AttentionMetadata):
        return h + self.mamba(self.rms_norm(h, self.norm, self.eps), meta)


class MambaForCausalLM(HybridForward):
    renames = RENAMED
    serves_loras = True  # on its mixers' projections (their checkpoints' `backbone.layers.N.mixer.*` names)
    stored_convolutions = (".mamba.conv1d.weight",)

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        return MambaLayer(self.config, self.kernels, dtype, layer)

    def lora_target(self, module: str) -> Target | None:
        return super().lora_target("model." + module.removeprefix("backbone.") if module.startswith("backbone.")
                                   else module)

    def _lora_rows(self, layer: int, place: str, proj: str) -> Target | None:
        mixer = self.layers[layer].mamba
        if place != "mixer":
            return None
        return mamba1_lora_rows(mixer, layer, proj) if isinstance(mixer, Mamba1Mixer) else \
            super()._lora_rows(layer, "mamba", proj)

    def checkpoint_names(self) -> list[str]:
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        names += [] if self.config.tie_word_embeddings else ["lm_head.weight"]
        for i, layer in enumerate(self.layers):
            names += [f"model.layers.{i}.norm.weight", *(f"model.layers.{i}.mamba.{name}"
                                                        for name in layer.mamba.tensor_names())]
        return names

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".")
        if parts[1] != "layers":
            return super()._target(name)
        layer = self.layers[int(parts[2])]
        return layer.norm.data if parts[3] == "norm" else layer.mamba.tensor(".".join(parts[4:]))
