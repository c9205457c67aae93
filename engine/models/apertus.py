"""Swiss AI's Apertus (ApertusForCausalLM) over paged KV: Llama's layers with

- q and k normed per head (ModelConfig.qk_norm);
- norms named `attention_layernorm` and `feedforward_layernorm` (Llama's input and post-attention norms);
- an MLP without a gate whose activation is xIELU (arXiv 2411.13010), of four numbers a layer it learnt: for
  x > 0, a_p x^2 + b x; else (expm1(min(x, eps)) - x) a_n + b x, with a_p = softplus(alpha_p) and
  a_n = b + softplus(alpha_n).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_layers import MLP, DecoderLayer
from engine.models.parameters import empty_param
from kernels.registry import Kernels

XIELU = ("alpha_p", "alpha_n", "beta", "eps")
APERTUS_RENAMED = ((".attention_layernorm.", ".input_layernorm."),
                   (".feedforward_layernorm.", ".post_attention_layernorm."))


class XieluMLP(MLP):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype) -> None:
        super().__init__(config, kernels, dtype)
        for name in XIELU:
            self.register_parameter(name, empty_param(1, dtype=dtype))
        self.activation = self._xielu

    def _xielu(self, x: torch.Tensor) -> torch.Tensor:
        beta = self.beta
        alpha_p, alpha_n = F.softplus(self.alpha_p), beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + beta * x, (torch.expm1(torch.minimum(x, self.eps)) - x) * alpha_n
                           + beta * x)


class ApertusForCausalLM(LlamaForCausalLM):
    renames = APERTUS_RENAMED

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        decoder = DecoderLayer(self.config, self.kernels, dtype, self._window(layer))
        decoder.mlp = XieluMLP(self.config, self.kernels, dtype)
        return decoder

    def _mlp_names(self, layer: int) -> list[str]:
        return [*super()._mlp_names(layer), *(f"model.layers.{layer}.mlp.act_fn.{name}" for name in XIELU)]

    def _placed(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if ".mlp.act_fn." in name:  # beta and eps stored as scalars, the alphas as one number each
            return self._target(name), tensor.reshape(1)
        return super()._placed(name, tensor)

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".")
        if len(parts) == 6 and parts[3:5] == ["mlp", "act_fn"]:
            return getattr(self.layers[int(parts[2])].mlp, parts[5]).data
        return super()._target(name)
