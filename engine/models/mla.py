"""Multi-head latent attention (DeepSeek-V3, and the models built on it: R1, V3.1, Kimi K2), over
Baton's paged KV: q through a low-rank projection and a norm; k and v made per head from a normed
latent, plus a RoPE part of k that every head shares.

The pages hold each head's k and v (v padded to k's width), not the latent: what the model computes
is MLA's, but its KV takes the room of ordinary attention's, not MLA's much smaller latent cache.

Each head is laid out RoPE part first ([rope, nope] instead of DeepSeek's [nope, rope]: q·k is the
same sum), so the RoPE kernels turn the first `qk_rope_head_dim` dimensions as they do for partial
RoPE. DeepSeek's weights hold each RoPE pair's dimensions side by side (`rope_interleave`); their
rows are reordered as they load so that the usual pairing, half a part apart, is the same rotation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.model_config import ModelConfig
from engine.models.llama import KVCache, paged_attention
from engine.models.parameters import empty_param
from kernels.registry import Kernels


class MLAttention(nn.Module):
    lora: None = None  # LoRA adapters on MLA's projections are not served

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, sliding_window: int | None) -> None:
        super().__init__()
        mla = config.mla
        self.config, self.mla, self.kernels = config, mla, kernels
        self.scale = config.attention_scale
        self.sliding_window = sliding_window
        heads, hidden = config.num_heads, config.hidden_size
        q_size = heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_weight = empty_param(q_size, hidden, dtype=dtype)
        else:
            self.q_a_weight = empty_param(mla.q_lora_rank, hidden, dtype=dtype)
            self.q_a_bias = empty_param(mla.q_lora_rank, dtype=dtype) if config.qkv_bias else None
            self.q_a_norm = empty_param(mla.q_lora_rank, dtype=dtype)
            self.q_b_weight = empty_param(q_size, mla.q_lora_rank, dtype=dtype)
        self.kv_a_weight = empty_param(mla.kv_lora_rank + mla.qk_rope_head_dim, hidden, dtype=dtype)
        self.kv_a_bias = empty_param(mla.kv_lora_rank + mla.qk_rope_head_dim, dtype=dtype) if config.qkv_bias else None
        self.kv_a_norm = empty_param(mla.kv_lora_rank, dtype=dtype)
        self.kv_b_weight = empty_param(heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank, dtype=dtype)
        self.o_weight = empty_param(hidden, heads * mla.v_head_dim, dtype=dtype)
        self.o_bias = empty_param(hidden, dtype=dtype) if config.o_bias else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        cfg, mla, ops = self.config, self.mla, self.kernels
        num_tokens, heads, rope, nope = x.shape[0], cfg.num_heads, mla.qk_rope_head_dim, mla.qk_nope_head_dim
        if mla.q_lora_rank is None:
            q = F.linear(x, self.q_weight)
        else:
            q_latent = ops.rms_norm(F.linear(x, self.q_a_weight, self.q_a_bias), self.q_a_norm, cfg.rms_norm_eps)
            q = F.linear(q_latent, self.q_b_weight)
        q = q.view(num_tokens, heads, mla.qk_head_dim)
        latent, k_rope = F.linear(x, self.kv_a_weight, self.kv_a_bias).split([mla.kv_lora_rank, rope], dim=-1)
        kv = F.linear(ops.rms_norm(latent, self.kv_a_norm, cfg.rms_norm_eps), self.kv_b_weight)
        k_nope, v = kv.view(num_tokens, heads, nope + mla.v_head_dim).split([nope, mla.v_head_dim], dim=-1)
        q = torch.cat((q[..., nope:], q[..., :nope]), dim=-1)  # [rope, nope]
        k = torch.cat((k_rope.unsqueeze(1).expand(num_tokens, heads, rope), k_nope), dim=-1)
        q, k = ops.apply_rope(q, k, cos, sin)
        pad = cfg.head_dim - mla.qk_head_dim
        if pad:  # a v wider than k (no DeepSeek model has one): k and q padded, their dot product as it was
            q, k = F.pad(q, (0, pad)), F.pad(k, (0, pad))
        v = F.pad(v, (0, cfg.head_dim - mla.v_head_dim))
        out = paged_attention(ops, q, k, v, kv_cache, meta, self.scale, self.sliding_window, None)
        attended = out[..., :mla.v_head_dim].reshape(num_tokens, heads * mla.v_head_dim)
        return F.linear(attended, self.o_weight, self.o_bias)

    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Copies checkpoint tensor `name` (`q_a_proj.weight`, ...: its name within `self_attn`) into place."""
        targets = {"q_proj.weight": "q_weight", "q_a_proj.weight": "q_a_weight", "q_a_proj.bias": "q_a_bias",
                   "q_a_layernorm.weight": "q_a_norm", "q_b_proj.weight": "q_b_weight",
                   "kv_a_proj_with_mqa.weight": "kv_a_weight", "kv_a_proj_with_mqa.bias": "kv_a_bias",
                   "kv_a_layernorm.weight": "kv_a_norm", "kv_b_proj.weight": "kv_b_weight",
                   "o_proj.weight": "o_weight", "o_proj.bias": "o_bias"}
        target = getattr(self, targets[name]).data
        if target.shape != tensor.shape:
            raise ValueError(f"tensor self_attn.{name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(target.shape)}")
        if self.mla.rope_interleave and name in ("q_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
                                                 "kv_a_proj_with_mqa.bias"):
            tensor = self._rope_rows_paired_apart(name, tensor)
        target.copy_(tensor)

    def _rope_rows_paired_apart(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        # Rows (2i, 2i + 1) of each RoPE part are a pair: their even rows first, then their odd
        # ones, makes the pair (i, i + rope/2) that the kernels turn, by the same angle.
        mla, rope = self.mla, self.mla.qk_rope_head_dim
        order = torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))
        rows = torch.arange(tensor.shape[0])
        if name.startswith("kv_a"):
            starts = [mla.kv_lora_rank]
        else:
            starts = [h * mla.qk_head_dim + mla.qk_nope_head_dim for h in range(self.config.num_heads)]
        for start in starts:
            rows[start:start + rope] = start + order
        return tensor[rows]

    def checkpoint_names(self, prefix: str) -> list[str]:
        if self.mla.q_lora_rank is None:
            names = ["q_proj.weight"]
        else:
            names = ["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"]
            names += ["q_a_proj.bias"] if self.q_a_bias is not None else []
        names += ["kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"]
        names += ["kv_a_proj_with_mqa.bias"] if self.kv_a_bias is not None else []
        names += ["o_proj.bias"] if self.o_bias is not None else []
        return [prefix + name for name in names]
