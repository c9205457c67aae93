"""BitNet b1.58 (BitNetForCausalLM; microsoft/bitnet-b1.58-2B-4T): Llama's layers with squared ReLU in the MLP and a
norm before each projection back (attention's output normed before o_proj, `attn_sub_norm`; the MLP's before
down_proj, `ffn_sub_norm`). Where its checkpoint holds ternary weights (engine/bitnet_weights.py), they are
dequantized as they load and every projection's input is quantized per token to 8 bits on its way in, as
transformers' BitNet layers compute; without `quantization_config` (its "-bf16" master weights) it computes as
transformers does then, in full precision throughout."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from engine.bitnet_weights import SCALE, dequantized, fake_quantized
from engine.lora import LoRAError, Target
from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_layers import MLP, Attention, DecoderLayer
from engine.models.parameters import empty_param
from kernels.registry import Kernels

SUB_NORMS = {"self_attn.attn_sub_norm.weight": "attn", "mlp.ffn_sub_norm.weight": "mlp"}
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
PROJECTION_WEIGHTS = tuple(f"{projection}.weight" for projection in PROJECTIONS)


def _inputs(config: ModelConfig):
    """What a projection's input goes through on its way in: 8-bit per-token quantization where the weights are
    ternary."""
    return fake_quantized if config.bitnet is not None else (lambda x: x)


class BitNetAttention(Attention):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, sliding_window: int | None) -> None:
        super().__init__(config, kernels, dtype, sliding_window)
        self.sub_norm = empty_param(config.q_size, dtype=dtype)
        self.quantized = _inputs(config)

    def _qkv(self, x):
        return super()._qkv(self.quantized(x))

    def _attended(self, out):
        attended = self.kernels.rms_norm(super()._attended(out), self.sub_norm, self.config.rms_norm_eps)
        return self.quantized(attended)


class BitNetMLP(MLP):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype) -> None:
        super().__init__(config, kernels, dtype)
        self.rms_norm, self.eps = kernels.rms_norm, config.rms_norm_eps
        self.sub_norm = empty_param(config.intermediate_size, dtype=dtype)
        self.quantized = _inputs(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear(self.quantized(x), self.gate_up_weight).split(self.intermediate_size, dim=-1)
        made = self.rms_norm(self.activation(gate) * up, self.sub_norm, self.eps)
        return self.linear(self.quantized(made), self.down_weight)


class BitNetForCausalLM(LlamaForCausalLM):
    splits_across_ranks = False  # (its sub-norms over whole projections' widths)

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        return DecoderLayer(self.config, self.kernels, dtype, self._window(layer), attention=BitNetAttention,
                            mlp=BitNetMLP(self.config, self.kernels, dtype))

    def lora_target(self, module: str) -> Target | None:
        raise LoRAError("LoRA adapters are not supported for BitNet (its projections' inputs quantized) yet")

    def checkpoint_names(self) -> list[str]:
        names = []
        for name in super().checkpoint_names():
            if self.config.bitnet is not None and self.config.bitnet.stores_scales and \
                    name.endswith(PROJECTION_WEIGHTS):
                names.append(name.removesuffix(".weight") + SCALE)  # read before its weight
            names.append(name)
        return names + [f"model.layers.{i}.{norm}" for i in range(self.config.num_layers) for norm in SUB_NORMS]

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._dequantized(tensors) if self.config.bitnet is not None else tensors)

    def _dequantized(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each projection's weight dequantized by its scale (read just before it)."""
        scales = {}
        for name, tensor in tensors:
            if name.endswith(SCALE):
                scales[name.removesuffix(SCALE)] = tensor
                continue
            stem = name.removesuffix(".weight")
            if stem.endswith(PROJECTIONS):
                tensor = dequantized(tensor, scales.pop(stem, None), self.config.bitnet, self._target(name).shape[0])
            yield name, tensor

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".")
        if len(parts) > 4 and ".".join(parts[3:]) in SUB_NORMS:
            layer = self.layers[int(parts[2])]
            return (layer.attn if SUB_NORMS[".".join(parts[3:])] == "attn" else layer.mlp).sub_norm.data
        return super()._target(name)
