"""AI21's Jamba (JambaForCausalLM): Mamba-1 layers between attention layers without positions (no RoPE: the Mamba
layers carry order), every other layer's MLP experts (top-2 by softmax, weighed by their unrenormalized scores).

A Mamba-1 layer projects x and a gate z; x runs through a short depthwise causal convolution and SiLU; from it dt (a
low rank, then up), B and C, each RMS-normed (Jamba's own norms); the selective scan (kernels/selective_scan.py)
over the sequence's state, a skip of D x, gated by SiLU of z, projected back. Its states live in the sequence's state
pages (engine/recurrent_state.py). Checkpoint names are read as Llama's where the layers are.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.lora import LoRAHook, Target
from engine.mamba1_config import UNNORMED, WEIGHTED
from engine.model_config import ModelConfig
from engine.models.bamba import BambaForCausalLM
from engine.models.llama_layers import MLP
from engine.models.moe import SparseMoE
from engine.models.parameters import empty_param
from kernels import selective_scan as scan
from kernels.causal_conv import conv_run, conv_step
from kernels.registry import Kernels

# Jamba's names and Llama's, each way (the more particular first).
RENAMED = ((".feed_forward.router.", ".mlp.gate."), (".feed_forward.", ".mlp."),
           (".pre_ff_layernorm.", ".post_attention_layernorm."), ("model.final_layernorm.", "model.norm."))
# A Mamba-1 layer's tensors as checkpoints name them (under its layer's `mamba.`), by its attributes.
TENSORS = {"in_proj.weight": "in_weight", "in_proj.bias": "in_bias", "conv1d.weight": "conv_weight",
           "conv1d.bias": "conv_bias", "x_proj.weight": "x_weight", "dt_proj.weight": "dt_weight",
           "dt_proj.bias": "dt_bias", "A_log": "a_log", "D": "d", "out_proj.weight": "out_weight",
           "out_proj.bias": "out_bias", "dt_layernorm.weight": "dt_norm", "b_layernorm.weight": "b_norm",
           "c_layernorm.weight": "c_norm"}


class Mamba1Mixer(nn.Module):
    """`index`: its place among the model's Mamba layers (its states')."""

    takes_lora = True  # the step's adapters on its projections (in, x, dt, out), where its model serves them
    lora: LoRAHook | None = None

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, index: int) -> None:
        super().__init__()
        self.linear, self.rms_norm, self.index = kernels.linear, kernels.rms_norm, index
        self.layout = m = config.mamba1
        hidden, channels, state = config.hidden_size, m.channels, m.state_size
        self.in_weight = empty_param(2 * channels, hidden, dtype=dtype)  # x, then the gate z
        self.in_bias = empty_param(2 * channels, dtype=dtype) if m.proj_bias else None
        self.conv_weight = empty_param(channels, m.conv_kernel, dtype=dtype)
        self.conv_bias = empty_param(channels, dtype=dtype) if m.conv_bias else None
        self.x_weight = empty_param(m.dt_rank + 2 * state, channels, dtype=dtype)  # dt's low rank, B, C
        self.dt_weight = empty_param(channels, m.dt_rank, dtype=dtype)
        self.dt_bias = empty_param(channels, dtype=dtype)
        self.a_log = empty_param(channels, state, dtype=dtype)
        self.d = empty_param(channels, dtype=dtype)
        self.out_weight = empty_param(hidden, channels, dtype=dtype)
        self.out_bias = empty_param(hidden, dtype=dtype) if m.proj_bias else None
        weighted = m.bcdt_norms == WEIGHTED
        self.dt_norm = empty_param(m.dt_rank, dtype=dtype) if weighted else None
        self.b_norm = empty_param(state, dtype=dtype) if weighted else None
        self.c_norm = empty_param(state, dtype=dtype) if weighted else None
        self.norm_eps = m.norm_eps or config.rms_norm_eps

    def tensor_names(self) -> list[str]:
        return [name for name, attr in TENSORS.items() if getattr(self, attr) is not None]

    def tensor(self, name: str) -> torch.Tensor:
        return getattr(self, TENSORS[name]).data

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        m, batch = self.layout, meta.recurrent
        windows, states = batch.layer(self.index)
        states = states[:, 0]  # [B, channels, state_size]: the one head it keeps
        xs, gate = self._projected("in", x, self.in_weight, self.in_bias).chunk(2, dim=-1)
        convolved = torch.empty_like(xs)
        batch.advance(convolved, windows, lambda row: batch.kept_layer(row, self.index)[0],
                      lambda tokens, before: conv_step(xs[tokens], before, self.conv_weight, self.conv_bias),
                      lambda start, end, window: conv_run(xs[start:end], window, self.conv_weight, self.conv_bias))
        xs = F.silu(convolved)
        dt, b, c = self._projected("x", xs, self.x_weight).split([m.dt_rank, m.state_size, m.state_size], dim=-1)
        dt = self._projected("dt", self._normed(dt, self.dt_norm), self.dt_weight)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        b, c = (self._normed(t, norm).float() for t, norm in ((b, self.b_norm), (c, self.c_norm)))
        a, inputs = -self.a_log.float().exp(), xs.float()
        y = torch.empty(xs.shape, dtype=torch.float32, device=x.device)

        def run(start, end, state):
            return scan.run(inputs[start:end], dt[start:end], a, b[start:end], c[start:end], state)

        batch.advance(y, states, lambda row: batch.kept_layer(row, self.index)[1][:, 0],
                      lambda tokens, before: scan.step(inputs[tokens], dt[tokens], a, b[tokens], c[tokens], before),
                      run)
        y = (y + self.d.float() * inputs) * F.silu(gate.float())
        return self._projected("out", y.to(x.dtype), self.out_weight, self.out_bias)

    def _normed(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """dt's low rank, B or C RMS-normed as the model norms them (by `weight`, without one, or not)."""
        if self.layout.bcdt_norms == UNNORMED:
            return x
        if weight is None:
            return F.rms_norm(x.float(), (x.shape[-1],), eps=self.norm_eps).type_as(x)
        return self.rms_norm(x, weight, self.norm_eps)

    def _projected(self, group: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """`x` through projection `group` (in, x, dt, out), with the step's adapters' deltas on it."""
        out = self.linear(x, weight, bias)
        return out if self.lora is None else self.lora.add(group, x, out)


def mamba1_lora_rows(mixer: Mamba1Mixer, layer: int, proj: str) -> Target | None:
    """Where an adapter on a Mamba-1 layer's projection `proj` (in_proj, x_proj, dt_proj, out_proj) adds."""
    group = {"in_proj": "in", "x_proj": "x", "dt_proj": "dt", "out_proj": "out"}.get(proj)
    return None if group is None else (layer, group, 0, getattr(mixer, f"{group}_weight").shape[0])


class MambaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, index: int, is_sparse: bool) -> None:
        super().__init__()
        self.eps, self.rms_norm = config.rms_norm_eps, kernels.rms_norm
        self.input_norm = empty_param(config.hidden_size, dtype=dtype)
        self.post_attention_norm = empty_param(config.hidden_size, dtype=dtype)
        self.mamba = Mamba1Mixer(config, kernels, dtype, index)
        self.mlp = SparseMoE(config, kernels, dtype) if is_sparse else MLP(config, kernels, dtype)

    def forward(self, h, cos, sin, kv_cache, meta):
        h = h + self.mamba(self.rms_norm(h, self.input_norm, self.eps), meta)
        return h + self.mlp(self.rms_norm(h, self.post_attention_norm, self.eps))


class JambaForCausalLM(BambaForCausalLM):  # (its checkpoint read as Bamba's is, by its own names)
    renames = RENAMED

    def _lora_rows(self, layer: int, place: str, proj: str) -> Target | None:
        mixer = getattr(self.layers[layer], "mamba", None)
        if place == "mamba" and isinstance(mixer, Mamba1Mixer):
            return mamba1_lora_rows(mixer, layer, proj)
        return super()._lora_rows(layer, place, proj)

    @property
    def _mamba_layers(self) -> tuple[int, ...]:
        return self.config.mamba1.mamba_layers

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        if layer not in self._mamba_layers:
            return super()._make_layer(layer, dtype)
        return MambaDecoderLayer(self.config, self.kernels, dtype, self._mamba_layers.index(layer),
                                 self._is_sparse(layer))
