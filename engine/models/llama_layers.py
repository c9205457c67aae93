"""A Llama-family decoder layer over paged KV: attention (q/k/v fused, optional q/k norms, sinks and
q temperature), the gated MLP, and the pre-norm residual block that joins them. Other architectures
reuse or subclass these; the model that stacks them is engine/models/llama.py.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.lora import LoRAHook
from engine.model_config import ModelConfig, QTemperature
from engine.models.alibi import alibi_slopes
from engine.models.moe import SparseMoE
from engine.models.parameters import empty_param
from kernels.registry import Kernels

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [Hkv, N, bs, D]
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"), "gelu": F.gelu,
               "relu": F.relu, "relu2": lambda x: F.relu(x).square()}


def paged_attention(ops: Kernels, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                    kv_cache: KVCache, meta: AttentionMetadata, scale: float, sliding_window: int | None,
                    softcap: float | None, chunk_size: int | None = None,
                    sinks: torch.Tensor | None = None, head_parts: int = 1, bidirectional: bool = True,
                    alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """The step's new k and v written into their pages, then each token's attention over its
    sequence's pages: q [T, Hq, D], k and v [T, Hkv, D] → [T, Hq, D] (decode rows first). k and v None:
    the pages hold them already (another layer's, which this one shares: Gemma 4's). `head_parts`: of
    the pages' heads each of k's spans (kernels/attention.py). `bidirectional`: whether the chunks' spans of tokens
    attending to each other both ways (an image's) do so in this layer."""
    k_cache, v_cache = kv_cache
    if k is not None:
        page_dim = k_cache.shape[-1]
        ops.write_kv(k.reshape(k.shape[0], -1, page_dim), v.reshape(v.shape[0], -1, page_dim), k_cache, v_cache,
                     meta.slot_mapping)
    num_decode, num_tokens = meta.num_decode_tokens, q.shape[0]
    if num_decode == num_tokens:
        return ops.decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale,
                                    sliding_window, softcap, chunk_size, sinks, head_parts, alibi_slopes)
    out = torch.empty_like(q)
    if num_decode:
        out[:num_decode] = ops.decode_attention(q[:num_decode], k_cache, v_cache, meta.decode_block_tables,
                                                meta.decode_context_lens, scale, sliding_window, softcap, chunk_size,
                                                sinks, head_parts, alibi_slopes)
    for chunk in meta.prefills:
        s, e = chunk.start, chunk.end
        out[s:e] = ops.prefill_attention(q[s:e], *((None, None) if k is None else (k[s:e], v[s:e])),
                                         k_cache, v_cache, chunk.block_table, chunk.context_len, scale,
                                         sliding_window, softcap, chunk_size, sinks,
                                         chunk.bidirectional if bidirectional else (), head_parts, alibi_slopes)
    return out


def q_temperature(q: torch.Tensor, temperature: QTemperature, positions: torch.Tensor) -> torch.Tensor:
    """q [T, H, D] scaled by each token's attention temperature at its position (positions [T])."""
    t = temperature
    if t.power:
        scales = (1.0 + (positions.float() + t.offset) / t.floor_scale) ** t.scale
    else:
        scales = torch.log1p(torch.floor((positions.float() + t.offset) / t.floor_scale)) * t.scale + 1.0  # [T]
    return (q * scales[:, None, None]).to(q.dtype)


# Set by a model split across ranks (engine/tensor_parallel.py): a projection back to the hidden size made
# from this rank's heads or width alone, summed across the ranks.
RankSum = Callable[[torch.Tensor], torch.Tensor]


class Attention(nn.Module):
    lora: LoRAHook | None = None  # set by the model: adds the step's LoRA deltas to q, k, v and o
    rank_sum: RankSum | None = None
    num_ranks = 1  # the ranks whose heads `rank_sum` sums over

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, sliding_window: int | None) -> None:
        super().__init__()
        self.config = config
        self.kernels = kernels
        self.scale = config.attention_scale
        self.sliding_window = sliding_window
        self.softcap = config.attn_logit_softcapping
        # q, k and v projections fused into one matmul; load_weights fills the slices.
        self.qkv_weight = empty_param(config.q_size + 2 * config.kv_size, config.hidden_size, dtype=dtype)
        self.qkv_bias = empty_param(config.q_size + 2 * config.kv_size, dtype=dtype) if config.qkv_bias else None
        self.o_weight = empty_param(config.hidden_size, config.q_size, dtype=dtype)
        self.o_bias = empty_param(config.hidden_size, dtype=dtype) if config.o_bias else None
        # Each head's q and k normed (Qwen3, Gemma 3), or the whole q and k projections (OLMo 2).
        self.is_qk_norm_per_head = config.qk_norm in ("head", "head_after_rope")
        self.norms_after_rope = config.qk_norm == "head_after_rope"  # HunYuan's
        q_norm_size, k_norm_size = (config.head_dim, config.head_dim) if self.is_qk_norm_per_head else \
            (config.q_size, config.kv_size)
        self.q_norm = empty_param(q_norm_size, dtype=dtype) if config.qk_norm else None
        self.k_norm = empty_param(k_norm_size, dtype=dtype) if config.qk_norm else None
        self.sinks = empty_param(config.num_heads, dtype=dtype) if config.attention_sinks else None  # gpt-oss's
        self.register_buffer("alibi_slopes", alibi_slopes(config.alibi, config.num_heads)
                             if config.alibi is not None else None, persistent=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        cfg, ops = self.config, self.kernels
        q, k, v = self._qkv(x)
        if self.q_norm is not None and self.is_qk_norm_per_head and not self.norms_after_rope:  # over head_dim
            q, k = ops.rms_norm(q, self.q_norm, cfg.rms_norm_eps), ops.rms_norm(k, self.k_norm, cfg.rms_norm_eps)
        if cos is not None:
            q, k = ops.apply_rope(q, k, cos, sin)
        if self.norms_after_rope:
            q, k = ops.rms_norm(q, self.q_norm, cfg.rms_norm_eps), ops.rms_norm(k, self.k_norm, cfg.rms_norm_eps)
        if cfg.q_temperature is not None and cfg.q_temperature.layers is None:  # Ministral 3's
            q = q_temperature(q, cfg.q_temperature, meta.positions)
        return self._output(paged_attention(ops, q, k, v, kv_cache, meta, self.scale, self.sliding_window,
                                            self.softcap, sinks=self.sinks, alibi_slopes=self.alibi_slopes))

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D]: projected (with the step's LoRA deltas), the whole
        projections normed where the model norms them so (OLMo 2)."""
        cfg, num_tokens = self.config, x.shape[0]
        qkv = self.kernels.linear(x, self.qkv_weight, self.qkv_bias)  # [T, q + 2kv]
        if self.lora is not None:
            self.lora.add("qkv", x, qkv)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        if self.q_norm is not None and not self.is_qk_norm_per_head:
            q, k = self._projection_norms(q, k)
        return (q.view(num_tokens, cfg.num_heads, cfg.head_dim), k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim),
                v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim))

    def _projection_norms(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, q_size] and k [T, kv_size] RMS-normed over the whole projections (OLMo 2's). Split across
        ranks, each holds its heads' part of them: the squares are summed across the ranks first, so that
        every rank norms its part by the whole projection's mean."""
        eps = self.config.rms_norm_eps
        if self.rank_sum is None:
            return self.kernels.rms_norm(q, self.q_norm, eps), self.kernels.rms_norm(k, self.k_norm, eps)
        q32, k32 = q.float(), k.float()
        squares = self.rank_sum(torch.stack((q32.pow(2).sum(-1), k32.pow(2).sum(-1)), dim=-1))  # [T, 2]
        q_scale = torch.rsqrt(squares[:, :1] / (q.shape[-1] * self.num_ranks) + eps)
        k_scale = torch.rsqrt(squares[:, 1:] / (k.shape[-1] * self.num_ranks) + eps)
        # As kernels' rms_norm computes outside float32: normed in float32, cast, then weighed.
        return self.q_norm * (q32 * q_scale).to(q.dtype), self.k_norm * (k32 * k_scale).to(k.dtype)

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        """Attention's output [T, Hq, D] through o_proj (with the step's LoRA delta): [T, hidden]."""
        attended = self._attended(out)
        projected = self.kernels.linear(attended, self.o_weight, self.o_bias)
        if self.lora is not None:
            projected = self.lora.add("o", attended, projected)
        return projected if self.rank_sum is None else self.rank_sum(projected)

    def _attended(self, out: torch.Tensor) -> torch.Tensor:
        """o_proj's input [T, in] of attention's output [T, Hq, D]."""
        return out.view(out.shape[0], self.config.q_size)


class GatedOutputAttention(Attention):
    """Attention whose output is weighed by the sigmoid of a projection of the layer's input (`gate_proj`): a number a
    head (LFM3's), or one an output element (Trinity's: `per_element`)."""

    per_element = False

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, sliding_window: int | None) -> None:
        super().__init__(config, kernels, dtype, sliding_window)
        rows = config.q_size if self.per_element else config.num_heads
        self.g_weight = empty_param(rows, config.hidden_size, dtype=dtype)
        self._gates: torch.Tensor | None = None  # the step's, while its attention runs

    def forward(self, x, cos, sin, kv_cache, meta):
        self._gates = self._gate(self.kernels.linear(x, self.g_weight))
        try:
            return super().forward(x, cos, sin, kv_cache, meta)
        finally:
            self._gates = None

    @staticmethod
    def _gate(projected: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(projected)

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        heads = out.view(out.shape[0], self.config.num_heads, -1)
        gates = self._gates.view(out.shape[0], self.config.num_heads, -1)  # [T, H, 1] or [T, H, D]
        return super()._output(heads * gates.to(heads.dtype))


class ElementGatedAttention(GatedOutputAttention):
    per_element = True


class MLP(nn.Module):
    """gate and up fused (`gate_up_weight`: gate's rows, then up's), the activation of gate times up, then down; or,
    without a gate (ModelConfig.mlp_gated), up alone (`gate_up_weight` its rows) through the activation."""

    lora: LoRAHook | None = None  # set by the model: adds the step's LoRA deltas to gate, up and down
    rank_sum: RankSum | None = None

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = kernels.linear
        self.intermediate_size = config.intermediate_size
        self.activation = ACTIVATIONS.get(config.hidden_act)  # (a model of another's sets its own)
        self.is_gated = config.mlp_gated
        rows = (1 + self.is_gated) * config.intermediate_size
        self.gate_up_weight = empty_param(rows, config.hidden_size, dtype=dtype)
        self.down_weight = empty_param(config.hidden_size, config.intermediate_size, dtype=dtype)
        self.gate_up_bias = empty_param(rows, dtype=dtype) if config.mlp_bias else None
        self.down_bias = empty_param(config.hidden_size, dtype=dtype) if config.mlp_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.linear(x, self.gate_up_weight, self.gate_up_bias)
        if self.lora is not None:
            self.lora.add("gate_up", x, gate_up)
        if self.is_gated:
            h = self._glu(*gate_up.split(self.intermediate_size, dim=-1))
        else:
            h = self.activation(gate_up)
        out = self.linear(h, self.down_weight, self.down_bias)
        if self.lora is not None:
            out = self.lora.add("down", h, out)
        return out if self.rank_sum is None else self.rank_sum(out)

    def _glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.activation(gate) * up


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, sliding_window: int | None = None,
                 is_sparse: bool = False, attention: type[nn.Module] = Attention, mlp: nn.Module | None = None) -> None:
        """`mlp`: a model's own MLP or experts for the layer; None: Llama's."""
        super().__init__()
        self.eps = config.rms_norm_eps
        self.rms_norm = kernels.rms_norm
        self.input_norm = empty_param(config.hidden_size, dtype=dtype)
        self.post_attention_norm = empty_param(config.hidden_size, dtype=dtype)
        self.attn = attention(config, kernels, dtype, sliding_window)
        self.mlp = mlp if mlp is not None else SparseMoE(config, kernels, dtype) if is_sparse else \
            MLP(config, kernels, dtype)

    def forward(self, h, cos, sin, kv_cache, meta):
        h = h + self.attn(self.rms_norm(h, self.input_norm, self.eps), cos, sin, kv_cache, meta)
        return h + self.mlp(self.rms_norm(h, self.post_attention_norm, self.eps))
