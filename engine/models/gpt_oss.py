"""gpt-oss (GptOssForCausalLM), as `transformers` computes it: Llama's decoder with q/k/v/o biases,
sliding-window attention (128) in every other layer, YaRN, attention sinks (a learnt logit per q head
joins each softmax: kernels/attention.py), and in every layer a mixture of experts routed by the
softmax of the top-k router logits, whose experts have biases and gate as (up + 1) * gate *
sigmoid(1.702 gate) with gate and up clamped (engine/models/moe.py).

Experts are stored fused, `gate_up_proj` [E, hidden, 2 inter] with gate and up interleaved column by
column, `down_proj` [E, inter, hidden]; they are split and transposed into place as they load.
Checkpoints quantized to MXFP4, as gpt-oss is released, have their experts dequantized as they load
(engine/mxfp4_weights.py).
"""
from __future__ import annotations

import torch

from engine.models.llama import LlamaForCausalLM


class GptOssForCausalLM(LlamaForCausalLM):
    def _mlp_names(self, layer: int) -> list[str]:
        p = f"model.layers.{layer}.mlp."
        return [p + "router.weight", p + "router.bias", *(p + f"experts.{x}" for x in (
            "gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"))]

    def _placed(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        parts = name.split(".")
        if len(parts) > 4 and parts[3] == "mlp":
            return self._expert_target(int(parts[2]), ".".join(parts[4:]), tensor)
        return super()._placed(name, tensor)

    def _expert_target(self, layer: int, leaf: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where `mlp.<leaf>` of `layer` goes, and the tensor as it goes there: gate's rows, then up's."""
        moe = self.layers[layer].mlp
        if leaf in ("router.weight", "router.bias"):
            return (moe.router_weight if leaf == "router.weight" else moe.router_bias).data, tensor
        if leaf == "experts.gate_up_proj":  # [E, in, 2 inter], gate and up interleaved
            fused = tensor.transpose(1, 2)
            return moe.gate_up_weight.data, torch.cat((fused[:, 0::2], fused[:, 1::2]), dim=1)
        if leaf == "experts.gate_up_proj_bias":
            return moe.gate_up_bias.data, torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)
        if leaf == "experts.down_proj":
            return moe.down_weight.data, tensor.transpose(1, 2)
        if leaf == "experts.down_proj_bias":
            return moe.down_bias.data, tensor
        raise KeyError(f"unexpected checkpoint tensor {leaf!r} of layer {layer}")
