"""Liquid AI's LFM2 (Lfm2ForCausalLM: LFM2 350M to 2.6B; Lfm2MoeForCausalLM: LFM2-8B-A1B): short gated convolutions
between grouped-query attention layers (engine/short_conv_config.py).

- A convolution layer projects its input to B, C and x; B * x runs through a depthwise causal convolution of a few
  taps (no activation), continuing from the sequence's last inputs (its state pages: engine/recurrent_state.py);
  C gates the result, projected back.
- An attention layer norms each head's q and k (`q_layernorm`, `k_layernorm`) before RoPE.
- Every layer's MLP is SwiGLU (`w1`, `w3`, `w2`); LFM2-MoE's, after its first dense layers, experts of that kind
  chosen by sigmoid score plus a learnt bias, weighed by their scores (renormalized, scaled), as DeepSeek-V3's
  router with one group.
- The final norm is named `embedding_norm`. The checkpoint's names are read as Llama's where the layers are.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.lora import LoRAHook, Target
from engine.model_config import ModelConfig
from engine.models.hybrid import HybridForward
from engine.models.llama_layers import MLP, Attention, GatedOutputAttention
from engine.models.moe import SparseMoE
from engine.models.parameters import empty_param
from engine.weights import renamed
from kernels.causal_conv import conv_run, conv_step
from kernels.registry import Kernels

# LFM2's names and Llama's, each way (the more particular first).
RENAMED = ((".operator_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."),
           (".self_attn.out_proj.", ".self_attn.o_proj."), (".q_layernorm.", ".q_norm."), (".k_layernorm.", ".k_norm."),
           (".feed_forward.expert_bias", ".mlp.gate.e_score_correction_bias"), (".feed_forward.", ".mlp."),
           (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."),
           ("model.embedding_norm.", "model.norm."))


class ShortConv(nn.Module):
    """A convolution layer's operator; `index`: its place among the model's convolution layers (its states')."""

    takes_lora = True  # the step's adapters on its projections in ("in") and out, where its model serves them
    lora: LoRAHook | None = None

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, index: int) -> None:
        super().__init__()
        self.linear, self.index = kernels.linear, index
        layout, hidden = config.short_conv, config.hidden_size
        self.in_weight = empty_param(3 * hidden, hidden, dtype=dtype)
        self.conv_weight = empty_param(hidden, layout.conv_kernel, dtype=dtype)
        self.out_weight = empty_param(hidden, hidden, dtype=dtype)
        self.in_bias, self.conv_bias, self.out_bias = (
            (empty_param(3 * hidden, dtype=dtype), empty_param(hidden, dtype=dtype), empty_param(hidden, dtype=dtype))
            if layout.conv_bias else (None, None, None))

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        projected = self.linear(x, self.in_weight, self.in_bias)
        if self.lora is not None:
            self.lora.add("in", x, projected)
        b, c, inputs = projected.chunk(3, dim=-1)
        gated = b * inputs
        windows, _ = meta.recurrent.layer(self.index)
        out = torch.empty_like(gated)
        meta.recurrent.advance(out, windows, lambda row: meta.recurrent.kept_layer(row, self.index)[0],
                               lambda tokens, before: conv_step(gated[tokens], before, self.conv_weight,
                                                                self.conv_bias),
                               lambda start, end, window: conv_run(gated[start:end], window, self.conv_weight,
                                                                   self.conv_bias))
        y = c * out
        projected = self.linear(y, self.out_weight, self.out_bias)
        return projected if self.lora is None else self.lora.add("out", y, projected)

    def tensor(self, leaf: str) -> torch.Tensor:
        """Where `conv.<leaf>` goes."""
        named = {"in_proj.weight": self.in_weight, "in_proj.bias": self.in_bias, "conv.weight": self.conv_weight,
                 "conv.bias": self.conv_bias, "out_proj.weight": self.out_weight, "out_proj.bias": self.out_bias}
        return named[leaf].data

    def tensor_names(self) -> list[str]:
        kinds = ("weight", "bias") if self.in_bias is not None else ("weight",)
        return [f"{x}.{kind}" for x in ("in_proj", "conv", "out_proj") for kind in kinds]


class ConvDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, index: int, is_sparse: bool) -> None:
        super().__init__()
        self.eps, self.rms_norm = config.rms_norm_eps, kernels.rms_norm
        self.input_norm = empty_param(config.hidden_size, dtype=dtype)
        self.post_attention_norm = empty_param(config.hidden_size, dtype=dtype)
        self.conv = ShortConv(config, kernels, dtype, index)
        self.mlp = SparseMoE(config, kernels, dtype) if is_sparse else MLP(config, kernels, dtype)

    def forward(self, h, cos, sin, kv_cache, meta):
        h = h + self.conv(self.rms_norm(h, self.input_norm, self.eps), meta)
        return h + self.mlp(self.rms_norm(h, self.post_attention_norm, self.eps))


class Lfm2ForCausalLM(HybridForward):
    renames = RENAMED
    serves_loras = True  # on its attention, its convolution layers' projections in and out, its dense MLPs

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        conv_layers = self.config.short_conv.conv_layers
        if layer not in conv_layers:
            return super()._make_layer(layer, dtype)
        return ConvDecoderLayer(self.config, self.kernels, dtype, conv_layers.index(layer), self._is_sparse(layer))

    def _attention_names(self, layer: int) -> list[str]:
        if layer in self.config.short_conv.conv_layers:
            return [f"model.layers.{layer}.conv.{name}" for name in self.layers[layer].conv.tensor_names()]
        return super()._attention_names(layer)

    def _placed(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if name.endswith(".conv.conv.weight"):  # [C, 1, K]
            tensor = tensor.squeeze(1)
        return super()._placed(name, tensor)

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".", 4)
        if len(parts) == 5 and parts[3] == "conv":
            return self.layers[int(parts[2])].conv.tensor(parts[4])
        return super()._target(name)

    def lora_target(self, module: str) -> Target | None:
        return super().lora_target(renamed(module + ".", self.renames).removesuffix("."))  # (LFM2's names)

    def _lora_rows(self, layer: int, place: str, proj: str) -> Target | None:
        if place == "conv" and layer in self.config.short_conv.conv_layers:
            hidden = self.config.hidden_size
            return {"in_proj": (layer, "in", 0, 3 * hidden), "out_proj": (layer, "out", 0, hidden)}.get(proj)
        return super()._lora_rows(layer, place, proj)


# LFM3's names and Llama's: its attention's are Llama's (q_norm, k_norm, o_proj; its gate gate_proj).
LFM3_RENAMED = ((".operator_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."),
                (".feed_forward.w1.", ".mlp.gate_proj."), (".feed_forward.w3.", ".mlp.up_proj."),
                (".feed_forward.w2.", ".mlp.down_proj."), ("model.embedding_norm.", "model.norm."))


class SandwichLayer(nn.Module):
    """LFM3's layer: its operator (attention or a convolution) and its MLP, each behind an RMS norm and (where the
    model has them) before another, the residual around each."""

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, operator: nn.Module,
                 is_conv: bool) -> None:
        super().__init__()
        self.eps, self.rms_norm, self.is_conv = config.rms_norm_eps, kernels.rms_norm, is_conv
        hidden, sandwich = config.hidden_size, config.short_conv.sandwich_norms
        self.input_norm = empty_param(hidden, dtype=dtype)
        self.post_attention_norm = empty_param(hidden, dtype=dtype)
        self.post_operator_norm = empty_param(hidden, dtype=dtype) if sandwich else None
        self.post_ffn_norm = empty_param(hidden, dtype=dtype) if sandwich else None
        if is_conv:
            self.conv = operator
        else:
            self.attn = operator
        self.mlp = MLP(config, kernels, dtype)

    def forward(self, h, cos, sin, kv_cache, meta):
        x = self.rms_norm(h, self.input_norm, self.eps)
        out = self.conv(x, meta) if self.is_conv else self.attn(x, cos, sin, kv_cache, meta)
        h = h + self._normed(out, self.post_operator_norm)
        return h + self._normed(self.mlp(self.rms_norm(h, self.post_attention_norm, self.eps)), self.post_ffn_norm)

    def _normed(self, out: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        return out if norm is None else self.rms_norm(out, norm, self.eps)


class Lfm3ForCausalLM(Lfm2ForCausalLM):
    """LFM3: LFM2's convolutions between attention layers, some of them within a sliding window (RoPE of their own
    there; a proportional one, part of each head turning, in the full ones), each head's output gated, every
    operator's and MLP's output normed (engine/short_conv_config.py's flags)."""

    renames = LFM3_RENAMED
    serves_loras = False  # (its attention's gates and sandwich norms not yet checked with adapters)

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        config, conv_layers = self.config, self.config.short_conv.conv_layers
        if layer in conv_layers:
            return SandwichLayer(config, self.kernels, dtype, ShortConv(config, self.kernels, dtype,
                                                                         conv_layers.index(layer)), is_conv=True)
        attention = GatedOutputAttention if config.short_conv.attention_gates else Attention
        return SandwichLayer(config, self.kernels, dtype, attention(config, self.kernels, dtype, self._window(layer)),
                             is_conv=False)

    def _attention_names(self, layer: int) -> list[str]:
        gate = [f"model.layers.{layer}.self_attn.gate_proj.weight"] \
            if layer not in self.config.short_conv.conv_layers and self.config.short_conv.attention_gates else []
        return super()._attention_names(layer) + gate

    def _norm_names(self) -> tuple[str, ...]:
        sandwich = ("post_operator_norm", "post_ffn_norm") if self.config.short_conv.sandwich_norms else ()
        return (*super()._norm_names(), *sandwich)

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".")
        if len(parts) == 5 and parts[3] in ("post_operator_norm", "post_ffn_norm"):
            return getattr(self.layers[int(parts[2])], parts[3]).data
        if len(parts) == 6 and parts[3:5] == ["self_attn", "gate_proj"]:
            return self.layers[int(parts[2])].attn.g_weight.data
        return super()._target(name)
