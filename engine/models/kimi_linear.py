"""Moonshot's Kimi-Linear (KimiLinearForCausalLM: Kimi-Linear-48B-A3B): Kimi Delta Attention layers (KDA) between
multi-head latent attention layers without positions (engine/models/mla.py; no RoPE, its RoPE part of k still
shared), DeepSeek-V3's experts after the first dense layers (grouped sigmoid routing, shared experts).

A KDA layer projects q, k and v, convolves them over the last few tokens (depthwise, causal) and SiLU, normalizes q
and k, and runs the gated delta rule with a decay per key channel (kernels/kimi_delta_rule.py; the decay's log
-exp(A_log) softplus(f_b f_a x + dt_bias), beta a sigmoid of b_proj x) over the sequence's state; its output is
RMS-normed a head and gated by the sigmoid of g_b g_a x, projected back. Its states live in the sequence's state
pages (engine/recurrent_state.py). Both kinds of layer keep their tensors under `self_attn.`; the expert layers
theirs under `block_sparse_moe.` (Mixtral's w1, w2 and w3, the shared experts beside them), the dense ones under
`mlp.`.
"""
from __future__ import annotations

import functools
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.model_config import ModelConfig
from engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from engine.models.hybrid import HybridForward
from engine.models.llama_layers import DecoderLayer
from engine.models.parameters import empty_param
from kernels import gated_delta_rule as rule, kimi_delta_rule as kda
from kernels.causal_conv import conv_run, conv_step
from kernels.registry import Kernels

# A KDA layer's tensors as its checkpoint names them (under `self_attn.`), by its attributes; q, k and v's
# convolutions are rows of one.
TENSORS = {"f_a_proj.weight": "f_a_weight", "f_b_proj.weight": "f_b_weight", "dt_bias": "dt_bias", "A_log": "a_log",
           "b_proj.weight": "b_weight", "g_a_proj.weight": "g_a_weight", "g_b_proj.weight": "g_b_weight",
           "o_norm.weight": "o_norm", "o_proj.weight": "o_weight"}
PROJECTIONS = ("q", "k", "v")


class KimiDeltaAttention(nn.Module):
    """`index`: its place among the model's KDA layers (its states'). Called as any attention layer is (positions and
    pages unread)."""

    tensors = TENSORS  # its own tensors as its checkpoints name them (under `self_attn.`), by its attributes

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, sliding_window: int | None,
                 index: int) -> None:
        super().__init__()
        self.linear, self.eps, self.index = kernels.linear, config.rms_norm_eps, index
        self.layout = la = config.linear_attention
        hidden, width, heads, head_dim = config.hidden_size, la.key_size, la.num_key_heads, la.key_head_dim
        self.qkv_weight = empty_param(3 * width, hidden, dtype=dtype)
        self.conv_weight = empty_param(3 * width, la.conv_kernel, dtype=dtype)
        self.dt_bias = empty_param(width, dtype=torch.float32)
        self.a_log = empty_param(heads, dtype=torch.float32)
        self.b_weight = empty_param(heads, hidden, dtype=dtype)
        self.o_norm = empty_param(head_dim, dtype=dtype)
        self.o_weight = empty_param(hidden, width, dtype=dtype)
        self._make_gates(hidden, width, head_dim, dtype)

    def _make_gates(self, hidden: int, width: int, head_dim: int, dtype: torch.dtype) -> None:
        """The forget gate's and output gate's projections: low-rank, through a head's width."""
        self.f_a_weight = empty_param(head_dim, hidden, dtype=dtype)
        self.f_b_weight = empty_param(width, head_dim, dtype=dtype)
        self.g_a_weight = empty_param(head_dim, hidden, dtype=dtype)
        self.g_b_weight = empty_param(width, head_dim, dtype=dtype)

    def _forget_gate_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.linear(x, self.f_a_weight), self.f_b_weight)

    def _output_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.linear(x, self.g_a_weight), self.g_b_weight)

    def forward(self, x: torch.Tensor, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        la, batch, num_tokens = self.layout, meta.recurrent, x.shape[0]
        windows, states = batch.layer(self.index)
        mixed = self.linear(x, self.qkv_weight)
        convolved = torch.empty_like(mixed)
        batch.advance(convolved, windows, lambda row: batch.kept_layer(row, self.index)[0],
                      lambda tokens, before: conv_step(mixed[tokens], before, self.conv_weight),
                      lambda start, end, window: conv_run(mixed[start:end], window, self.conv_weight))
        shape = (num_tokens, la.num_key_heads, la.key_head_dim)
        q, k, v = (t.float().reshape(shape) for t in F.silu(convolved).chunk(3, dim=-1))
        q, k = rule.l2_normed(q) * la.key_head_dim ** -0.5, rule.l2_normed(k)
        gate_in = (self._forget_gate_input(x).float() + self.dt_bias).view(shape)
        rates, bound = self.a_log.float().exp()[:, None], la.forget_gate_bound
        g = -rates * F.softplus(gate_in) if bound is None else bound * torch.sigmoid(rates * gate_in)
        beta = torch.sigmoid(self.linear(x, self.b_weight).float())
        out = torch.empty(shape, dtype=torch.float32, device=x.device)

        def run(start, end, state):
            return kda.run(q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end], state)

        batch.advance(out, states, lambda row: batch.kept_layer(row, self.index)[1],
                      lambda tokens, before: kda.step(q[tokens], k[tokens], v[tokens], g[tokens], beta[tokens],
                                                      before), run)
        gate = self._output_gate(x).float().view(shape)
        normed = F.rms_norm(out, (la.key_head_dim,), self.o_norm.float(), eps=self.eps) * torch.sigmoid(gate)
        return self.linear(normed.to(x.dtype).view(num_tokens, -1), self.o_weight)

    def checkpoint_names(self, prefix: str) -> list[str]:
        return [prefix + name for name in (*(f"{p}_proj.weight" for p in PROJECTIONS),
                                           *(f"{p}_conv1d.weight" for p in PROJECTIONS), *self.tensors)]

    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Copies checkpoint tensor `name` (its name within `self_attn`) into place."""
        width = self.layout.key_size
        projection = name.split("_", 1)[0]
        if name in self.tensors:
            target = getattr(self, self.tensors[name]).data
            tensor = tensor.reshape(target.shape) if name == "A_log" else tensor  # stored [1, 1, H, 1]
        elif name.endswith("_conv1d.weight"):  # [C, 1, K], one of q's, k's and v's
            start = PROJECTIONS.index(projection) * width
            target, tensor = self.conv_weight.data[start:start + width], tensor.squeeze(1)
        else:
            start = PROJECTIONS.index(projection) * width
            target = self.qkv_weight.data[start:start + width]
        if target.shape != tensor.shape:
            raise ValueError(f"tensor self_attn.{name!r} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(target.shape)}")
        target.copy_(tensor)


class KimiLinearForCausalLM(HybridForward, DeepseekV3ForCausalLM):
    delta_attention: ClassVar[type[KimiDeltaAttention]] = KimiDeltaAttention  # its KDA layers'

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        linear_layers = self.config.linear_attention.linear_layers
        if layer not in linear_layers:
            return super()._make_layer(layer, dtype)  # MLA (DeepSeek-V3's)
        kda_layer = functools.partial(self.delta_attention, index=linear_layers.index(layer))
        return DecoderLayer(self.config, self.kernels, dtype, None, self._is_sparse(layer), attention=kda_layer)

    def _mlp_names(self, layer: int) -> list[str]:
        if not self._is_sparse(layer):
            return super()._mlp_names(layer)
        p, moe = f"model.layers.{layer}.block_sparse_moe.", self.config.moe
        return [p + "gate.weight", p + "gate.e_score_correction_bias",
                *(p + f"experts.{e}.{w}.weight" for e in range(moe.num_experts) for w in ("w1", "w2", "w3")),
                *(p + f"shared_experts.{x}_proj.weight" for x in ("gate", "up", "down"))]
