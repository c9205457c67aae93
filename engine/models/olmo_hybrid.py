"""AI2's OLMo Hybrid (OlmoHybridForCausalLM): Gated DeltaNet layers (Qwen3.5's, engine/models/qwen3_next.py) between
OLMo 3's attention layers (engine/models/olmo2.py: norms after attention and the MLP, q and k normed over their
whole projections, no window).

- A linear-attention layer normalizes before its operator and its MLP, as Llama's; its q, k, v, gate (`g_proj`),
  b and a are projections of their own (placed where Qwen3.5's fused ones put them); each token's write strength
  ranges up to 2 (linear_allow_neg_eigval) and its output norm's epsilon is its own (LinearAttention's).
- No norm scales by 1 + weight. The checkpoint names a linear layer's norms `attention_layer_norm` (before its
  operator) and `feedforward_layer_norm` (before its MLP), an attention layer's `feedforward_layer_norm` (after
  attention) and `post_feedforward_layernorm`; and q's, k's and v's convolutions each apart (`q_conv1d`, ...), read
  as one, joined in that order as transformers joins them (whatever rows each holds: transformers saves the three
  as equal thirds).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.lora import Target
from engine.models.hybrid import HybridForward
from engine.models.olmo2 import Olmo2DecoderLayer
from engine.models.qwen3_next import HybridDecoderLayer

LINEAR_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "a_proj")
CONVOLUTIONS = ("q_conv1d", "k_conv1d", "v_conv1d")
LAYER_NORMS = {True: ("attention_layer_norm", "feedforward_layer_norm"),  # by whether the layer is linear
               False: ("feedforward_layer_norm", "post_feedforward_layernorm")}


class OlmoHybridForCausalLM(HybridForward):
    serves_loras = True  # on its attention, its linear attention's projections (each apart) and its dense MLPs

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        if self._is_linear(layer):
            return HybridDecoderLayer(self.config, self.kernels, dtype, layer)
        return Olmo2DecoderLayer(self.config, self.kernels, dtype, None, self._is_sparse(layer))

    def _is_linear(self, layer: int) -> bool:
        return layer in self.config.linear_attention.linear_layers

    def _norm_names(self) -> tuple[str, ...]:
        return ()  # a layer's own, by its kind (checkpoint_names)

    def checkpoint_names(self) -> list[str]:
        norms = [f"model.layers.{i}.{norm}.weight" for i in range(self.config.num_layers)
                 for norm in LAYER_NORMS[self._is_linear(i)]]
        return [*super().checkpoint_names(), *norms]

    def _attention_names(self, layer: int) -> list[str]:
        if not self._is_linear(layer):
            return super()._attention_names(layer)
        p = f"model.layers.{layer}.linear_attn."
        return [p + f"{x}.weight" for x in (*LINEAR_PROJECTIONS, *CONVOLUTIONS, "o_norm", "o_proj")] + [
            p + "dt_bias", p + "A_log"]

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        convolutions: dict[str, dict[str, torch.Tensor]] = {}  # a layer's, by name, until it has all three

        def joined() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in tensors:
                prefix, _, leaf = name.rpartition(".linear_attn.")
                if leaf.removesuffix(".weight") not in CONVOLUTIONS:
                    yield name, tensor
                    continue
                held = convolutions.setdefault(prefix, {})
                held[leaf.removesuffix(".weight")] = tensor
                if len(held) == len(CONVOLUTIONS):  # [C, 1, K] each
                    yield f"{prefix}.linear_attn.conv1d.weight", torch.cat([held.pop(c) for c in CONVOLUTIONS])

        super().load_weights(joined())

    def _placed(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if name.endswith(".linear_attn.conv1d.weight"):  # [C, 1, K]
            tensor = tensor.squeeze(1)
        return super()._placed(name, tensor)

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"]:
            return super()._target(name)
        layer = self.layers[int(parts[2])]
        norms = {"attention_layer_norm": "input_norm", "feedforward_layer_norm": "post_attention_norm",
                 "post_feedforward_layernorm": "post_feedforward_norm"}
        if parts[3] in norms:
            return getattr(layer, norms[parts[3]]).data
        if parts[3] != "linear_attn":
            return super()._target(name)
        attn = layer.attn
        if parts[4] in LINEAR_PROJECTIONS:
            lo, hi = self._linear_rows()[parts[4]]
            return attn.in_weight.data[lo:hi]
        return {"conv1d": attn.conv_weight, "o_norm": attn.norm, "o_proj": attn.out_weight, "dt_bias": attn.dt_bias,
                "A_log": attn.a_log}[parts[4]].data

    def _linear_rows(self) -> dict[str, tuple[int, int]]:
        """Where each projection into a linear-attention layer lies in its fused one: q, k, v (convolved), gate, b,
        a."""
        la = self.config.linear_attention
        ends = (la.key_size, 2 * la.key_size, la.conv_dim, la.conv_dim + la.value_size,
                la.conv_dim + la.value_size + la.num_value_heads, la.conv_dim + la.value_size + 2 * la.num_value_heads)
        return {proj: (ends[i - 1] if i else 0, ends[i]) for i, proj in enumerate(LINEAR_PROJECTIONS)}

    def _lora_rows(self, layer: int, place: str, proj: str) -> Target | None:
        if place == "linear_attn" and self._is_linear(layer):
            if proj == "o_proj":
                return layer, "out", 0, self.config.hidden_size
            return (layer, "in", *self._linear_rows()[proj]) if proj in LINEAR_PROJECTIONS else None
        return super()._lora_rows(layer, place, proj)
