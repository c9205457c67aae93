"""Step-3.7's text model (Step3p7ForConditionalGeneration's; engine/step3p7_config.py): Llama's layers with Gemma's
norms (1 + weight, added as they load) and q/k norms a head, attention's output weighed by the sigmoid of a projection
of the layer's input (a number a head), the sliding-window layers with q heads and a RoPE of their
own, and each layer's GLUs clamped by its own limits: the activated gate from above, up both ways.

Read by StepFun's names as released: each layer's experts stacked a projection at a time (`moe.gate_proj.weight`
[E, inter, hidden]), its router's bias `moe.router_bias`, its shared expert `share_expert`."""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_layers import MLP, DecoderLayer, GatedOutputAttention
from engine.models.moe import SparseMoE
from kernels.registry import Kernels

# Each layer's stacked experts' projections against the halves of Baton's fused gate/up and its down.
STACKED_EXPERTS = ("gate_proj", "up_proj", "down_proj")


def clamped_silu_glu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """SiLU(gate) * up, the first clamped from above by `limit`, up within ±`limit` (None: unclamped)."""
    if limit is None:
        return F.silu(gate) * up
    return F.silu(gate).clamp(max=limit) * up.clamp(min=-limit, max=limit)


class ClampedMLP(MLP):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, limit: float | None) -> None:
        super().__init__(config, kernels, dtype)
        self.limit = limit

    def _glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return clamped_silu_glu(gate, up, self.limit)


class ClampedSparseMoE(SparseMoE):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, limit: float | None,
                 shared_limit: float | None) -> None:
        super().__init__(config, kernels, dtype)
        self.limit, self.shared_limit = limit, shared_limit

    def _glu(self, gate: torch.Tensor, up: torch.Tensor, is_shared: bool) -> torch.Tensor:
        return clamped_silu_glu(gate, up, self.shared_limit if is_shared else self.limit)


class Step3p7ForCausalLM(LlamaForCausalLM):
    renames = ((".moe.gate.weight", ".mlp.gate.weight"), (".moe.router_bias", ".mlp.gate.e_score_correction_bias"),
               (".moe.", ".mlp.experts."), (".share_expert.", ".mlp.shared_experts."))
    has_mtp_layers = True  # released with num_nextn_predict_layers past its own: the first drafts (step3p7_mtp.py)

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        config, step = self._layer_config(layer), self.config.step3p7
        limit, shared_limit = step.swiglu_limits[layer], step.shared_swiglu_limits[layer]
        mlp = (ClampedSparseMoE(config, self.kernels, dtype, limit, shared_limit) if self._is_sparse(layer)
               else ClampedMLP(config, self.kernels, dtype, shared_limit))
        return DecoderLayer(config, self.kernels, dtype, self._window(layer), attention=GatedOutputAttention, mlp=mlp)

    def _attention_names(self, layer: int) -> list[str]:
        return [*super()._attention_names(layer), f"model.layers.{layer}.self_attn.g_proj.weight"]

    def _mlp_names(self, layer: int) -> list[str]:
        p = f"model.layers.{layer}.mlp."
        if not self._is_sparse(layer):
            return super()._mlp_names(layer)
        return [p + "gate.weight", p + "gate.e_score_correction_bias",
                *(p + f"experts.{proj}.weight" for proj in STACKED_EXPERTS),
                *(p + f"shared_experts.{proj}.weight" for proj in STACKED_EXPERTS)]

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((name, tensor.float() + 1.0 if name.endswith("norm.weight") else tensor)
                             for name, tensor in tensors)

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".")  # model.layers.N.mlp.experts.PROJ.weight: every expert's at once
        if len(parts) != 7 or parts[3:5] != ["mlp", "experts"] or parts[5] not in STACKED_EXPERTS:
            return super()._target(name)
        mlp, inter = self.layers[int(parts[2])].mlp, self.config.moe.moe_intermediate_size
        if parts[5] == "down_proj":
            return mlp.down_weight.data
        return mlp.gate_up_weight.data[:, :inter] if parts[5] == "gate_proj" else mlp.gate_up_weight.data[:, inter:]
