"""Nemotron (NemotronForCausalLM: Nemotron-4, Minitron, Nemotron-Mini): Llama's attention with RoPE over part of each
head, an MLP without a gate (up, squared ReLU, down: Jais 2's), and layer norms with biases that scale by 1 + weight
(the 1 added as the weights load, in float32, as transformers adds it)."""
from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.models.layer_norm_llama import Jais2ForCausalLM


class NemotronForCausalLM(Jais2ForCausalLM):
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((name, tensor.float() + 1.0 if name.endswith("norm.weight") else tensor)
                             for name, tensor in tensors)
