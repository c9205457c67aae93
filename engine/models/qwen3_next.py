"""Qwen3-Next and Qwen3.5 (Qwen3NextForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM; the text models of
Qwen3.5's multimodal checkpoints): three Gated DeltaNet linear-attention layers to one of full attention
(engine/linear_attention_config.py).

- A linear-attention layer projects q, k and v (one key head serving several value heads), convolves them
  over the last few tokens (depthwise, causal), and runs the gated delta rule (kernels/gated_delta_rule.py)
  over the sequence's recurrent state; its output is RMS-normed, gated by SiLU of a projection z, projected
  back. Its states live in the sequence's state pages (engine/recurrent_state.py); a step reads them before
  the forward and writes them back after (engine/model_runner.py).
- A full-attention layer projects each q head with a gate beside it: the output is weighed by its sigmoid.
  q and k are normed a head; RoPE turns a quarter of each head.
- Every RMS norm but the linear layers' output norm scales by 1 + weight (the 1 added as the weights load).
- Qwen3-Next stores q, k, v and z in one projection (and b and a in another) grouped by key head: the rows are
  put in Qwen3.5's order as they load.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.lora import LoRAHook, Target
from engine.model_config import ModelConfig
from engine.models.hybrid import HybridForward
from engine.models.llama_layers import MLP, Attention, KVCache, paged_attention
from engine.models.moe import SparseMoE
from engine.models.parameters import empty_param
from kernels import gated_delta_rule as rule
from kernels.causal_conv import conv_run, conv_step
from kernels.registry import Kernels

# Norms stored as offsets from 1 (the linear layers' output norm, linear_attn.norm, is not).
OFFSET_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight",
                "model.norm.weight")


class GatedAttention(Attention):
    """Full attention whose output is gated a head by a sigmoid of a second q-sized projection."""

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, sliding_window: int | None) -> None:
        super().__init__(config, kernels, dtype, sliding_window)
        # Each head's q rows then its gate rows, as the checkpoint's q_proj holds them.
        self.qkv_weight = empty_param(2 * config.q_size + 2 * config.kv_size, config.hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        cfg, ops, num_tokens = self.config, self.kernels, x.shape[0]
        qkv = ops.linear(x, self.qkv_weight)
        if self.lora is not None:
            self.lora.add("qkv", x, qkv)
        q_gate, k, v = qkv.split([2 * cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q, gate = q_gate.view(num_tokens, cfg.num_heads, 2 * cfg.head_dim).chunk(2, dim=-1)
        q = ops.rms_norm(q.contiguous(), self.q_norm, cfg.rms_norm_eps)
        k = ops.rms_norm(k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim), self.k_norm, cfg.rms_norm_eps)
        q, k = ops.apply_rope(q, k, cos, sin)
        out = paged_attention(ops, q, k, v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim), kv_cache, meta,
                              self.scale, None, None)
        gated = out.reshape(num_tokens, cfg.q_size) * torch.sigmoid(gate.reshape(num_tokens, cfg.q_size))
        return self._output(gated)


class GatedDeltaNet(nn.Module):
    """A linear-attention layer; `index`: its place among the model's linear-attention layers (its states')."""

    takes_lora = True  # the step's adapters on its projections in ("in") and out, where its model serves them
    lora: LoRAHook | None = None

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, index: int) -> None:
        super().__init__()
        self.linear, self.index = kernels.linear, index
        self.layout = la = config.linear_attention
        self.eps = la.output_norm_eps or config.rms_norm_eps
        # q, k, v (the convolved channels), then z, b and a: one matmul.
        self.in_weight = empty_param(la.conv_dim + la.value_size + 2 * la.num_value_heads, config.hidden_size,
                                     dtype=dtype)
        self.conv_weight = empty_param(la.conv_dim, la.conv_kernel, dtype=dtype)
        self.dt_bias = empty_param(la.num_value_heads, dtype=dtype)
        self.a_log = empty_param(la.num_value_heads, dtype=dtype)
        self.norm = empty_param(la.value_head_dim, dtype=dtype)
        self.out_weight = empty_param(config.hidden_size, la.value_size, dtype=dtype)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        la, num_tokens = self.layout, x.shape[0]
        windows, states = meta.recurrent.layer(self.index)
        projected = self.linear(x, self.in_weight)
        if self.lora is not None:
            self.lora.add("in", x, projected)
        mixed, z, b, a = projected.split([la.conv_dim, la.value_size, la.num_value_heads, la.num_value_heads], dim=-1)
        convolved = self._convolved(mixed, windows, meta)
        q, k, v = convolved.split([la.key_size, la.key_size, la.value_size], dim=-1)
        repeats = la.num_value_heads // la.num_key_heads  # each key head serves that many value heads, in turn
        q = rule.l2_normed(q.float().view(num_tokens, la.num_key_heads, la.key_head_dim)) * la.key_head_dim ** -0.5
        k = rule.l2_normed(k.float().view(num_tokens, la.num_key_heads, la.key_head_dim))
        q, k = q.repeat_interleave(repeats, dim=1), k.repeat_interleave(repeats, dim=1)
        v = v.view(num_tokens, la.num_value_heads, la.value_head_dim)
        beta = torch.sigmoid(b) if la.beta_scale == 1.0 else torch.sigmoid(b) * la.beta_scale
        g = -self.a_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # the log of each token's decay
        out = torch.empty(num_tokens, la.num_value_heads, la.value_head_dim, dtype=torch.float32, device=x.device)

        def step(tokens, before):
            return rule.recurrent_step(q[tokens], k[tokens], v[tokens], g[tokens], beta[tokens], before)

        def run(start, end, state):
            if end - start > 1:
                return rule.chunked(q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end], state)
            made, after = step(slice(start, end), state[None])  # a drafted sequence's token
            state.copy_(after[0])
            return made

        meta.recurrent.advance(out, states, lambda row: meta.recurrent.kept_layer(row, self.index)[1], step, run)
        normed = F.rms_norm(out, (la.value_head_dim,), eps=self.eps).to(x.dtype) * self.norm
        gate = torch.sigmoid if la.output_gate == "sigmoid" else F.silu
        gated = (normed.float() * gate(z.float().view(normed.shape))).to(x.dtype).view(num_tokens, la.value_size)
        out = self.linear(gated, self.out_weight)
        return out if self.lora is None else self.lora.add("out", gated, out)

    def _convolved(self, mixed: torch.Tensor, windows: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q, k and v through the causal convolution, each sequence continuing from its window, and SiLU."""
        out = torch.empty_like(mixed)
        meta.recurrent.advance(out, windows, lambda row: meta.recurrent.kept_layer(row, self.index)[0],
                               lambda tokens, before: conv_step(mixed[tokens], before, self.conv_weight),
                               lambda start, end, window: conv_run(mixed[start:end], window, self.conv_weight))
        return F.silu(out)


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, layer: int) -> None:
        super().__init__()
        self.eps, self.rms_norm = config.rms_norm_eps, kernels.rms_norm
        self.input_norm = empty_param(config.hidden_size, dtype=dtype)
        self.post_attention_norm = empty_param(config.hidden_size, dtype=dtype)
        # (none in a multi-token prediction layer's config: engine/models/qwen3_next_mtp.py)
        linear_layers = config.linear_attention.linear_layers if config.linear_attention is not None else ()
        self.is_linear = layer in linear_layers
        self.attn = GatedDeltaNet(config, kernels, dtype, linear_layers.index(layer)) if self.is_linear else \
            GatedAttention(config, kernels, dtype, None)
        self.mlp = SparseMoE(config, kernels, dtype) if config.moe.is_sparse(layer) else MLP(config, kernels, dtype)

    def forward(self, h, cos, sin, kv_cache, meta):
        x = self.rms_norm(h, self.input_norm, self.eps)
        h = h + (self.attn(x, meta) if self.is_linear else self.attn(x, cos, sin, kv_cache, meta))
        return h + self.mlp(self.rms_norm(h, self.post_attention_norm, self.eps))


class Qwen3NextForCausalLM(HybridForward):
    serves_loras = True  # on its attention, its linear attention's projections in and out, its dense MLPs

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        return HybridDecoderLayer(self.config, self.kernels, dtype, layer)

    def _lora_rows(self, layer: int, place: str, proj: str) -> Target | None:
        hidden = self.config.hidden_size
        if place == "self_attn":  # q's rows each head's q, then its gate
            if proj == "o_proj":
                return layer, "o", 0, hidden
            return (layer, "qkv", *self._attention_rows()[proj]) if proj in self._attention_rows() else None
        if place == "linear_attn":
            if proj == "out_proj":
                return layer, "out", 0, hidden
            return (layer, "in", *self._in_rows()[proj]) if proj in self._in_rows() else None
        return super()._lora_rows(layer, place, proj)

    def lora_matrices(self, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3-Next's fused projections' B rows grouped by key head in the checkpoint, in Qwen3.5's order as its
        weights' are."""
        projection = module.rsplit(".", 1)[-1]
        if ".linear_attn.in_proj_" in module and self.config.linear_attention.fused_projections:
            b = self._ungrouped(projection, b)
        return super().lora_matrices(module, a, b)

    def _attention_rows(self) -> dict[str, tuple[int, int]]:
        """Where q's (its gates beside), k's and v's projections lie in a full-attention layer's fused one."""
        q, kv = 2 * self.config.q_size, self.config.kv_size
        return {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}

    def _in_rows(self) -> dict[str, tuple[int, int]]:
        """Where each projection into a linear-attention layer lies in its fused one (q, k, v; z; b; a)."""
        la = self.config.linear_attention
        inner, heads = la.conv_dim + la.value_size, la.num_value_heads
        return {"in_proj_qkvz": (0, inner), "in_proj_qkv": (0, la.conv_dim), "in_proj_z": (la.conv_dim, inner),
                "in_proj_ba": (inner, inner + 2 * heads), "in_proj_b": (inner, inner + heads),
                "in_proj_a": (inner + heads, inner + 2 * heads)}

    def is_unused_tensor(self, name: str) -> bool:
        # Its multi-token prediction layer (mtp.*), which transformers leaves unread too.
        return name.startswith("mtp.") or super().is_unused_tensor(name)

    def _attention_names(self, layer: int) -> list[str]:
        linear = self.config.linear_attention
        if linear is None or layer not in linear.linear_layers:
            return super()._attention_names(layer)
        p = f"model.layers.{layer}.linear_attn."
        projections = ("in_proj_qkvz", "in_proj_ba") if self.config.linear_attention.fused_projections else \
            ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        return [p + f"{x}.weight" for x in (*projections, "conv1d", "norm", "out_proj")] + [p + "dt_bias",
                                                                                             p + "A_log"]

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((name, tensor.float() + 1.0 if name.endswith(OFFSET_NORMS) else tensor)
                             for name, tensor in tensors)

    def _placed(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if ".linear_attn.in_proj_" in name and self.config.linear_attention.fused_projections:
            tensor = self._ungrouped(name.rsplit(".", 2)[-2], tensor)
        elif name.endswith(".linear_attn.conv1d.weight"):  # [C, 1, K]
            tensor = tensor.squeeze(1)
        return super()._placed(name, tensor)

    def _ungrouped(self, projection: str, tensor: torch.Tensor) -> torch.Tensor:
        """Qwen3-Next's rows, grouped by key head ([q, k, v, z] or [b, a] a group), in Qwen3.5's order (every
        head's q, then k, v, z; every b, then a)."""
        la = self.config.linear_attention
        per_key = la.num_value_heads // la.num_key_heads
        parts = [la.key_head_dim, la.key_head_dim, per_key * la.value_head_dim, per_key * la.value_head_dim] \
            if projection == "in_proj_qkvz" else [per_key, per_key]
        grouped = tensor.view(la.num_key_heads, sum(parts), -1).split(parts, dim=1)
        return torch.cat([part.reshape(-1, tensor.shape[-1]) for part in grouped])

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".")
        if len(parts) < 5 or parts[3] not in ("linear_attn", "self_attn"):
            return super()._target(name)
        layer = self.layers[int(parts[2])]
        if parts[3] == "self_attn":
            if parts[4] in self._attention_rows():
                lo, hi = self._attention_rows()[parts[4]]
                return layer.attn.qkv_weight.data[lo:hi]
            return super()._target(name)
        attn, leaf = layer.attn, parts[4]
        if leaf.startswith("in_proj_"):
            lo, hi = self._in_rows()[leaf]
            return attn.in_weight.data[lo:hi]
        named = {"conv1d": attn.conv_weight, "norm": attn.norm, "out_proj": attn.out_weight, "dt_bias": attn.dt_bias,
                 "A_log": attn.a_log}
        return named[leaf].data
