"""Multi-head latent attention (DeepSeek-V3, and the models built on it: R1, V3.1, Kimi K2; DeepSeek-V2),
over Baton's paged KV: q through a low-rank projection and a norm; k and v made per head from a normed
latent, plus a RoPE part of k that every head shares.

The pages hold what MLA's cache should: per token, the shared RoPE part of k and the normed latent
(kernels/mla_attention.py lays them out), `rope + kv_lora_rank` numbers a layer (576 for DeepSeek-V3,
where per-head keys and values would take 40,960). Decode attends to them in the latent space, a prefill
chunk after projecting its context up to each head's k and v.

DeepSeek's weights hold each RoPE pair's dimensions side by side (`rope_interleave`); their rows are
reordered as they load so that the usual pairing, half a part apart, is the same rotation.

DeepSeek-V3.2's sparse attention (DSA): an indexer beside it scores every earlier token for each query (its own
small heads' ReLU'd dot products with a key a token, weighed by the query's heads' weights and summed), and the query
attends to the `index_topk` best alone. The indexer's key is a third part of each token's row in the pages, so it
moves, is cached and handed over with the rest. Hy4's (engine/models/hy_v4.py) turns its indexer's heads' last
dimensions by RoPE, gates each head's output by a projection of the layer's input and adds a sink logit a head to each
softmax.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_metadata import AttentionMetadata, PrefillChunk
from engine.model_config import ModelConfig
from engine.models.llama_layers import KVCache, RankSum, q_temperature
from engine.models.parameters import empty_param
from kernels.mla_attention import (
    causal_attention_torch,
    latent_decode_attention,
    mla_decode_attention_torch,
    read_latent_rows,
    sparse_selection,
    write_latent_rows,
)
from kernels.registry import Kernels
from kernels.rotary import pairs_half_apart

# DeepSeek-V3.2's indexer's tensors, by their names within self_attn.
INDEXER_TENSORS = {"indexer.wq_b.weight": "index_q_weight", "indexer.wk.weight": "index_k_weight",
                   "indexer.k_norm.weight": "index_k_norm", "indexer.k_norm.bias": "index_k_norm_bias",
                   "indexer.weights_proj.weight": "index_head_weights"}


class MLAttention(nn.Module):
    lora: None = None  # LoRA adapters on MLA's projections are not served
    # Set where the model is split across ranks (engine/tensor_parallel.py): o_proj made from this rank's heads
    # alone, summed across the ranks. Every rank writes the whole latent rows: they are the same on each.
    rank_sum: RankSum | None = None

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, sliding_window: int | None,
                 shares_choice: bool = False) -> None:
        """`shares_choice`: a layer of a sparse model without an indexer of its own (GLM-5's shared layers)."""
        super().__init__()
        mla = config.mla
        self.shares_choice = shares_choice
        self.config, self.mla, self.kernels = config, mla, kernels
        self.scale = config.attention_scale
        if sliding_window is not None:
            raise ValueError("multi-head latent attention has no sliding window")
        heads, hidden = config.num_heads, config.hidden_size
        q_size = heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_weight = empty_param(q_size, hidden, dtype=dtype)
        else:
            self.q_a_weight = empty_param(mla.q_lora_rank, hidden, dtype=dtype)
            self.q_a_bias = empty_param(mla.q_lora_rank, dtype=dtype) if config.qkv_bias else None
            self.q_a_norm = empty_param(mla.q_lora_rank, dtype=dtype)
            if mla.output_gate:  # each head's q, then its gate, from [q's normed latent | the latent]
                self.q_b_weight = empty_param(heads * (mla.qk_head_dim + mla.v_head_dim), 2 * mla.q_lora_rank,
                                              dtype=dtype)
            else:
                self.q_b_weight = empty_param(q_size, mla.q_lora_rank, dtype=dtype)
        self.kv_a_weight = empty_param(mla.kv_lora_rank + mla.qk_rope_head_dim, hidden, dtype=dtype)
        self.kv_a_bias = empty_param(mla.kv_lora_rank + mla.qk_rope_head_dim, dtype=dtype) if config.qkv_bias else None
        self.kv_a_norm = empty_param(mla.kv_lora_rank, dtype=dtype)
        self.kv_b_weight = empty_param(heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank, dtype=dtype)
        self.o_weight = empty_param(hidden, heads * mla.v_head_dim, dtype=dtype)
        self.o_bias = empty_param(hidden, dtype=dtype) if config.o_bias else None
        self.gate_weight = empty_param(heads * mla.head_gate_width, hidden, dtype=dtype) if mla.head_gate_width \
            else None
        self.sinks = empty_param(heads, dtype=dtype) if config.attention_sinks else None  # (Hy4's)
        self.has_indexer = bool(mla.index_topk) and not shares_choice
        if self.has_indexer:  # DeepSeek-V3.2's indexer (DSA): whole on every rank, as the latent is
            self.index_q_weight = empty_param(mla.index_heads * mla.index_head_dim, mla.q_lora_rank, dtype=dtype)
            self.index_k_weight = empty_param(mla.index_head_dim, hidden, dtype=dtype)
            self.index_k_norm = empty_param(mla.index_head_dim, dtype=dtype)
            self.index_k_norm_bias = empty_param(mla.index_head_dim, dtype=dtype)
            self.index_head_weights = empty_param(mla.index_heads, hidden, dtype=dtype)
            # A head's dimensions in the order that turns side-by-side RoPE pairs into pairs half apart (GLM-5's).
            order = torch.cat((pairs_half_apart(mla.qk_rope_head_dim),
                               torch.arange(mla.qk_rope_head_dim, mla.index_head_dim)))
            self.register_buffer("index_order", order, persistent=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        cfg, mla, ops = self.config, self.mla, self.kernels
        num_tokens, heads, rope, nope = x.shape[0], cfg.num_heads, mla.qk_rope_head_dim, mla.qk_nope_head_dim
        gates = None  # A.X K2's, Hy4's and Ling 3's, each head's output's
        if self.gate_weight is not None:
            gates = ops.linear(x, self.gate_weight).view(num_tokens, heads, mla.head_gate_width)
        if mla.q_lora_rank is None:
            q = ops.linear(x, self.q_weight)
        else:
            q_raw = ops.linear(x, self.q_a_weight, self.q_a_bias)
            q_latent = ops.rms_norm(q_raw, self.q_a_norm, mla.latent_norm_eps or cfg.rms_norm_eps)
            if mla.output_gate:
                q, gates = ops.linear(torch.cat((q_latent, q_raw), dim=-1), self.q_b_weight).view(
                    num_tokens, heads, mla.qk_head_dim + mla.v_head_dim).split([mla.qk_head_dim, mla.v_head_dim], -1)
            else:
                q = ops.linear(q_latent, self.q_b_weight)
        q_nope, q_rope = q.reshape(num_tokens, heads, mla.qk_head_dim).split([nope, rope], dim=-1)
        latent, k_rope = ops.linear(x, self.kv_a_weight, self.kv_a_bias).split([mla.kv_lora_rank, rope], dim=-1)
        latent = ops.rms_norm(latent, self.kv_a_norm, mla.latent_norm_eps or cfg.rms_norm_eps)
        if cos is not None:  # (Kimi-Linear's layers have no positions: their RoPE part of k is still shared)
            q_rope, k_rope = ops.apply_rope(q_rope, k_rope.unsqueeze(1), cos, sin)
        else:
            k_rope = k_rope.unsqueeze(1)
        if cfg.q_temperature is not None:  # Mistral 4's: q (both parts) scaled by its position
            q_nope = q_temperature(q_nope, cfg.q_temperature, meta.positions)
            q_rope = q_temperature(q_rope, cfg.q_temperature, meta.positions)
        parts = [k_rope.squeeze(1), latent]
        index = None  # DSA's queries and their heads' weights, a token
        if self.has_indexer:
            index_queries, index_weights, index_keys = self._indexer(x, q_latent, cos, sin)
            parts.append(index_keys)
        elif mla.index_topk:  # (a layer sharing another's choice keeps no key of its own)
            parts.append(latent.new_zeros(num_tokens, mla.index_head_dim))
        rows = torch.cat(parts, dim=-1)  # [T, rope + rank (+ index key)]: what the pages keep
        write_latent_rows(rows, *kv_cache, meta.slot_mapping)
        out = q.new_empty(num_tokens, heads, mla.v_head_dim)
        num_decode = meta.num_decode_tokens
        if num_decode:
            if self.has_indexer:
                index = index_queries[:num_decode], index_weights[:num_decode]
            out[:num_decode] = self._decode(q_nope[:num_decode], q_rope[:num_decode], kv_cache, meta, index)
        for chunk in meta.prefills:
            s, e = chunk.start, chunk.end
            if self.has_indexer:
                index = index_queries[s:e], index_weights[s:e]
            out[s:e] = self._prefill(q_nope[s:e], q_rope[s:e], rows[s:e], kv_cache, chunk, meta, index)
        if gates is not None:
            out = (out * torch.sigmoid(gates.float())).to(out.dtype)
        projected = ops.linear(out.view(num_tokens, heads * mla.v_head_dim), self.o_weight, self.o_bias)
        return projected if self.rank_sum is None else self.rank_sum(projected)

    def _up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's projections of the latent to its k (nope part) and to its v: [H, nope, rank],
        [H, v, rank] (kv_b's rows hold a head's k, then its v)."""
        mla = self.mla
        up = self.kv_b_weight.view(self.config.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        return up[:, :mla.qk_nope_head_dim], up[:, mla.qk_nope_head_dim:]

    def _indexer(self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """DSA's queries [T, Hi, D] (from q's latent), their heads' weights [T, Hi] and keys [T, D] (layer-normed),
        the first qk_rope_head_dim of each (Hy4's: the last) turned by RoPE, pairs half apart (unlike MLA's own)."""
        mla, ops, rope = self.mla, self.kernels, self.mla.qk_rope_head_dim
        queries = ops.linear(q_latent, self.index_q_weight).view(x.shape[0], mla.index_heads, mla.index_head_dim)
        keys = F.layer_norm(ops.linear(x, self.index_k_weight), (mla.index_head_dim,), self.index_k_norm,
                            self.index_k_norm_bias, eps=mla.index_norm_eps).unsqueeze(1)
        if mla.index_rope_interleave:  # pairs side by side: the even dimensions, then the odd, are pairs half apart
            queries, keys = queries[..., self.index_order], keys[..., self.index_order]
        start = mla.index_head_dim - rope if mla.index_rope_last else 0
        turned = slice(start, start + rope)
        turned_q, turned_k = ops.apply_rope(queries[..., turned].contiguous(), keys[..., turned].contiguous(), cos, sin)
        queries, keys = queries.clone(), keys.clone()
        queries[..., turned], keys[..., turned] = turned_q, turned_k
        keys = keys.squeeze(1)
        weights = ops.linear(x, self.index_head_weights).float() * mla.index_heads ** -0.5
        return queries, weights, keys

    def _chosen(self, meta: AttentionMetadata, where: str | int, index: tuple[torch.Tensor, torch.Tensor] | None,
                rows: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Which of `rows` (their index keys last) each query DSA lets attend (`visible` [..., n, T] narrowed): by
        this layer's indexer (its choice kept in `meta` for the layers sharing it), or the last one's."""
        if self.shares_choice:
            return meta.index_choices[where]
        mla = self.mla
        queries, weights = index
        chosen = sparse_selection(queries, weights, rows[..., mla.qk_rope_head_dim + mla.kv_lora_rank:], visible,
                                  mla.index_topk, mla.index_head_dim ** -0.5)
        meta.index_choices[where] = chosen
        return chosen

    def _decode(self, q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                index: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One new token a sequence, in the latent space: q_nope [B, H, nope], q_rope [B, H, rope] → [B, H, v].
        `index`: DSA's queries [B, Hi, D] and weights [B, Hi], where the model has them."""
        to_k, to_v = self._up_projections()
        q_absorbed = torch.einsum("bhn,hnr->bhr", q_nope, to_k)  # q_nope · k_nope without making k_nope
        if not self.mla.index_topk:
            attended = mla_decode_attention_torch(q_rope, q_absorbed, *kv_cache, meta.decode_block_tables,
                                                  meta.decode_context_lens, self.scale)  # [B, H, rank]
        else:
            rows = read_latent_rows(*kv_cache, meta.decode_block_tables, self.mla.cache_row_width, q_rope.dtype)
            positions = torch.arange(rows.shape[1], device=rows.device).unsqueeze(0)
            visible = (positions < meta.decode_context_lens.unsqueeze(1)).unsqueeze(1)  # [B, 1, L]
            if index is not None:
                index = index[0].unsqueeze(1), index[1].unsqueeze(1)
            chosen = self._chosen(meta, "decode", index, rows, visible)
            attended = latent_decode_attention(q_rope, q_absorbed, rows, chosen.squeeze(1), self.scale, self.sinks)
        return torch.einsum("bhr,hvr->bhv", attended, to_v)

    def _prefill(self, q_nope: torch.Tensor, q_rope: torch.Tensor, rows: torch.Tensor, kv_cache: KVCache,
                 chunk: PrefillChunk, meta: AttentionMetadata, index: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> torch.Tensor:
        """One sequence's chunk, its context's rows (the cached ones, then `rows`: [n, R]) projected up to
        each head's k and v: q_nope [n, H, nope], q_rope [n, H, rope] → [n, H, v]. `index`: DSA's queries
        [n, Hi, D] and weights [n, Hi], where the model has them."""
        mla, heads, rope = self.mla, self.config.num_heads, self.mla.qk_rope_head_dim
        num_new = rows.shape[0]
        if chunk.context_len:
            rows = self._context_rows(kv_cache, chunk, num_new)
        k_rope, latent = rows[:, :rope], rows[:, rope:rope + mla.kv_lora_rank]
        k_nope, v = self.kernels.linear(latent, self.kv_b_weight).view(
            -1, heads, mla.qk_nope_head_dim + mla.v_head_dim).split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        k = torch.cat((k_rope.unsqueeze(1).expand(-1, heads, rope), k_nope), dim=-1)
        chosen = None
        if mla.index_topk:
            total = rows.shape[0]
            positions = torch.arange(total, device=rows.device)
            visible = positions.unsqueeze(0) <= positions[total - num_new:].unsqueeze(1)  # [n, total]
            chosen = self._chosen(meta, chunk.start, index, rows, visible)
        return causal_attention_torch(torch.cat((q_rope, q_nope), dim=-1), k, v, chunk.context_len, self.scale,
                                      chosen, self.sinks)

    def _context_rows(self, kv_cache: KVCache, chunk: PrefillChunk, num_new: int) -> torch.Tensor:
        """The cached rows of a chunk's sequence up to its last new token: [context_len + num_new, R]."""
        total = chunk.context_len + num_new
        block_size = kv_cache[0].shape[2]
        blocks = chunk.block_table[:(total + block_size - 1) // block_size]
        return read_latent_rows(*kv_cache, blocks, self.mla.cache_row_width, self.kv_a_norm.dtype)[:total]

    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Copies checkpoint tensor `name` (`q_a_proj.weight`, ...: its name within `self_attn`) into place."""
        targets = {"q_proj.weight": "q_weight", "q_a_proj.weight": "q_a_weight", "q_a_proj.bias": "q_a_bias",
                   "q_a_layernorm.weight": "q_a_norm", "q_b_proj.weight": "q_b_weight",
                   "kv_a_proj_with_mqa.weight": "kv_a_weight", "kv_a_proj_with_mqa.bias": "kv_a_bias",
                   "kv_a_layernorm.weight": "kv_a_norm", "kv_b_proj.weight": "kv_b_weight",
                   "o_proj.weight": "o_weight", "o_proj.bias": "o_bias", "gate_proj.weight": "gate_weight",
                   "sinks": "sinks", **INDEXER_TENSORS}
        target = getattr(self, targets[name]).data
        if target.shape != tensor.shape:
            raise ValueError(f"tensor self_attn.{name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(target.shape)}")
        if self.mla.rope_interleave and name in ("q_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
                                                 "kv_a_proj_with_mqa.bias"):
            tensor = self._rope_rows_paired_apart(name, tensor)
        target.copy_(tensor)

    def _rope_rows_paired_apart(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        mla, rope = self.mla, self.mla.qk_rope_head_dim
        order = pairs_half_apart(rope)
        rows = torch.arange(tensor.shape[0])
        if name.startswith("kv_a"):
            starts = [mla.kv_lora_rank]
        else:  # (a head's rows: its q, then its output gate's where it has one)
            width = mla.qk_head_dim + (mla.v_head_dim if mla.output_gate and name == "q_b_proj.weight" else 0)
            starts = [h * width + mla.qk_nope_head_dim for h in range(self.config.num_heads)]
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
        names += ["gate_proj.weight"] if self.gate_weight is not None else []
        names += ["sinks"] if self.sinks is not None else []
        names += list(INDEXER_TENSORS) if self.has_indexer else []
        return [prefix + name for name in names]
