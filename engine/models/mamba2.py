"""A Mamba-2 layer over the step's recurrent states (Granite 4.0-H's: engine/mamba_config.py): x, B and C
projected and convolved over the last few tokens (depthwise, causal), the selective scan (kernels/ssd.py) over the
sequence's state with a skip of D x, the output gated by SiLU of a projection z, RMS-normed in groups, projected
back. Its states live in the sequence's state pages (engine/recurrent_state.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.lora import LoRAHook
from engine.mamba_config import NO_NORM, NORM_BEFORE_GATE
from engine.model_config import ModelConfig
from engine.models.parameters import empty_param
from kernels import ssd
from kernels.causal_conv import conv_run, conv_step
from kernels.registry import Kernels

# Its tensors as checkpoints name them (under a layer's `mamba.` or `mixer.`), by its attributes.
TENSORS = {"in_proj.weight": "in_weight", "in_proj.bias": "in_bias", "conv1d.weight": "conv_weight",
           "conv1d.bias": "conv_bias", "dt_bias": "dt_bias", "A_log": "a_log", "D": "d", "norm.weight": "norm",
           "out_proj.weight": "out_weight", "out_proj.bias": "out_bias"}


class Mamba2Mixer(nn.Module):
    """`index`: its place among the model's Mamba-2 layers (its states')."""

    takes_lora = True  # the step's adapters on its projections in ("in") and out, where its model serves them
    lora: LoRAHook | None = None

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, index: int) -> None:
        super().__init__()
        self.layout = m = config.mamba
        self.linear, self.eps, self.index = kernels.linear, m.norm_eps or config.rms_norm_eps, index
        width = m.intermediate_size + m.conv_dim + m.num_heads  # z, then x, B and C (the convolved), then dt
        self.in_weight = empty_param(width, config.hidden_size, dtype=dtype)
        self.in_bias = empty_param(width, dtype=dtype) if m.proj_bias else None
        self.conv_weight = empty_param(m.conv_dim, m.conv_kernel, dtype=dtype)
        self.conv_bias = empty_param(m.conv_dim, dtype=dtype) if m.conv_bias else None
        self.dt_bias = empty_param(m.num_heads, dtype=dtype)
        self.a_log = empty_param(m.num_heads, dtype=dtype)
        self.d = empty_param(m.num_heads, dtype=dtype)
        self.norm = empty_param(m.intermediate_size, dtype=dtype) if m.gated_norm != NO_NORM else None
        self.out_weight = empty_param(config.hidden_size, m.intermediate_size, dtype=dtype)
        out_bias = m.proj_bias if m.out_proj_bias is None else m.out_proj_bias
        self.out_bias = empty_param(config.hidden_size, dtype=dtype) if out_bias else None

    def tensor_names(self) -> list[str]:
        """Its tensors' names in a checkpoint (under its layer's prefix): its biases where it has them."""
        return [name for name, attr in TENSORS.items() if getattr(self, attr) is not None]

    def tensor(self, name: str) -> torch.Tensor:
        """Where checkpoint tensor `name` (under its layer's prefix) goes; its convolution's as [C, K]."""
        return getattr(self, TENSORS[name]).data

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        m, batch, num_tokens = self.layout, meta.recurrent, x.shape[0]
        windows, states = batch.layer(self.index)
        projected = self.linear(x, self.in_weight, self.in_bias)
        if self.lora is not None:
            self.lora.add("in", x, projected)
        z, xbc, dt = projected.split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
        convolved = torch.empty_like(xbc)
        batch.advance(convolved, windows, lambda row: batch.kept_layer(row, self.index)[0],
                      lambda tokens, before: conv_step(xbc[tokens], before, self.conv_weight, self.conv_bias),
                      lambda start, end, window: conv_run(xbc[start:end], window, self.conv_weight, self.conv_bias))
        xs, b, c = F.silu(convolved).split([m.intermediate_size, m.num_groups * m.state_size,
                                            m.num_groups * m.state_size], dim=-1)
        xs = xs.view(num_tokens, m.num_heads, m.head_dim)
        per_group = m.num_heads // m.num_groups  # each group's B and C serve that many heads, in turn
        b, c = (t.view(num_tokens, m.num_groups, m.state_size).repeat_interleave(per_group, dim=1) for t in (b, c))
        # A prompt token's steps clamped to dt_limit (a prompt of one token's, or a chunk's last, too), a decoded
        # token's not, as transformers' and mamba_ssm's scans over a prompt and steps after it do.
        dt = F.softplus(dt + self.dt_bias)
        if m.dt_limit != (0.0, float("inf")) and batch.prompt_tokens is not None:
            dt = torch.where(batch.prompt_tokens[:, None], dt.clamp(*m.dt_limit), dt)
        a = -self.a_log.float().exp()
        y = torch.empty(num_tokens, m.num_heads, m.head_dim, dtype=torch.float32, device=x.device)

        def step(tokens, before):
            return ssd.step(xs[tokens], dt[tokens], a, b[tokens], c[tokens], before)

        def run(start, end, state):
            if end - start > 1:
                return ssd.run(xs[start:end], dt[start:end], a, b[start:end], c[start:end], state)
            made, after = step(slice(start, end), state[None])  # a drafted sequence's token
            state.copy_(after[0])
            return made

        batch.advance(y, states, lambda row: batch.kept_layer(row, self.index)[1], step, run)
        y = (y + self.d.float()[:, None] * xs.float()).view(num_tokens, m.intermediate_size)
        gate = F.silu(z.float())
        if m.gated_norm == NO_NORM:
            return self._out((y * gate).to(x.dtype))
        grouped = (y if m.gated_norm == NORM_BEFORE_GATE else y * gate).view(num_tokens, m.num_groups, -1)
        normed = self.norm * F.rms_norm(grouped, (grouped.shape[-1],), eps=self.eps).view(num_tokens, -1).to(x.dtype)
        if m.gated_norm == NORM_BEFORE_GATE:
            normed = (normed.float() * gate).to(x.dtype)
        return self._out(normed)

    def _out(self, y: torch.Tensor) -> torch.Tensor:
        out = self.linear(y, self.out_weight, self.out_bias)
        return out if self.lora is None else self.lora.add("out", y, out)
