"""MiniMax-M3's text model (MiniMaxM3VLForCausalLM; engine/minimax_m3_config.py): Llama's layers with Gemma's norms
(1 + weight, added as they load; its indexer's kept in float32, as transformers computes them), clamped GLUs in its
dense MLPs and experts, and block-sparse attention (kernels/block_sparse_attention.py) in its sparse layers.

Every layer's pages hold one more KV head, the indexer's key of each token (its sparse layers' only; the full
layers attend over the others, as any layer does). Split across ranks, each holds its share of the KV heads and of
the indexer's heads (one a KV head), the indexer's key projection whole, and computes in whole pages."""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.model_config import ModelConfig
from engine.models.index_key_pages import by_sequence, write_with_index_keys
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_layers import MLP, Attention, DecoderLayer, KVCache, RankSum
from engine.models.moe import clamped_glu
from engine.models.parameters import empty_param
from kernels.block_sparse_attention import best_key_block_choice, chosen_attention, gathered_pages
from kernels.registry import Kernels
from kernels.rms_norm import rms_norm_scaled_in_float32

INDEXER_WEIGHTS = {"q_proj": "index_q_weight", "k_proj": "index_k_weight", "q_norm": "index_q_norm",
                   "k_norm": "index_k_norm"}


class ClampedGluMLP(MLP):
    """A dense MLP gated as its experts are (gate_up_proj fused: gate's rows, then up's)."""

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype) -> None:
        super().__init__(config, kernels, dtype)
        self.limit, self.alpha = config.moe.swiglu_limit, config.moe.swiglu_alpha

    def _glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return clamped_glu(gate, up, self.limit, self.alpha)


class PagedHeads:
    """Where an attention's KV heads lie in its pages, which every rank of a split model holds whole: its run of the
    KV heads (all of them where the model is whole), and the indexer's key head after every rank's."""

    def __init__(self, config: ModelConfig) -> None:
        self.kv_heads, self.index_head = slice(0, config.num_kv_heads), config.num_kv_heads

    def place(self, rank: int, num_ranks: int) -> None:
        """This attention as rank `rank`'s of `num_ranks`' (its share of the KV heads, engine/tensor_parallel.py's)."""
        share = self.kv_heads.stop - self.kv_heads.start
        self.kv_heads, self.index_head = slice(rank * share, (rank + 1) * share), share * num_ranks


class FullAttention(Attention, PagedHeads):
    """A full layer's attention, over its pages' KV heads (the last head, the sparse layers' indexer keys, left)."""

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, sliding_window: int | None) -> None:
        Attention.__init__(self, config, kernels, dtype, sliding_window)
        PagedHeads.__init__(self, config)

    def forward(self, x, cos, sin, kv_cache, meta):
        return super().forward(x, cos, sin, (kv_cache[0][self.kv_heads], kv_cache[1][self.kv_heads]), meta)


class BlockSparseAttention(Attention, PagedHeads):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, sliding_window: int | None) -> None:
        Attention.__init__(self, config, kernels, dtype, sliding_window)
        PagedHeads.__init__(self, config)
        self.indexer = indexer = config.minimax_m3
        self.index_q_weight = empty_param(indexer.num_heads * indexer.head_dim, config.hidden_size, dtype=dtype)
        self.index_k_weight = empty_param(indexer.head_dim, config.hidden_size, dtype=dtype)
        self.index_q_norm = empty_param(indexer.head_dim, dtype=torch.float32)
        self.index_k_norm = empty_param(indexer.head_dim, dtype=torch.float32)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        cfg, ops, indexer, num_tokens = self.config, self.kernels, self.indexer, x.shape[0]
        q, k, v = self._qkv(x)
        q, k = ops.rms_norm(q, self.q_norm, cfg.rms_norm_eps), ops.rms_norm(k, self.k_norm, cfg.rms_norm_eps)
        q, k = ops.apply_rope(q, k, cos, sin)
        index_q = rms_norm_scaled_in_float32(ops.linear(x, self.index_q_weight).view(num_tokens, indexer.num_heads, -1),
                                             self.index_q_norm, cfg.rms_norm_eps)
        index_k = rms_norm_scaled_in_float32(ops.linear(x, self.index_k_weight).view(num_tokens, 1, -1),
                                             self.index_k_norm, cfg.rms_norm_eps)
        index_q, index_k = ops.apply_rope(index_q, index_k, cos, sin)
        write_with_index_keys(ops, k, v, index_k.squeeze(1), kv_cache, meta, self.kv_heads, self.index_head)
        return self._output(by_sequence(q, index_q, meta, lambda rows, index_rows, blocks, context_len: self._attend(
            rows, index_rows, kv_cache, blocks, context_len)))

    def _attend(self, q: torch.Tensor, index_q: torch.Tensor, kv_cache: KVCache, block_table: torch.Tensor,
                context_len: int) -> torch.Tensor:
        """One sequence's n new tokens after `context_len` others, each head over the keys its KV head's indexer
        head chose: q [n, H, D], index_q [n, Hi, Di] → [n, H, D]."""
        cfg, indexer, k_cache = self.config, self.indexer, kv_cache[0]
        total = context_len + q.shape[0]
        blocks = block_table[:math.ceil(total / k_cache.shape[2])]
        keys = gathered_pages(k_cache, blocks, total).to(q.dtype)
        values = gathered_pages(kv_cache[1][self.kv_heads], blocks, total).to(q.dtype)
        scores = torch.matmul(index_q.float().transpose(0, 1), keys[self.index_head, :, :indexer.head_dim].float().t())
        allowed = best_key_block_choice(scores, context_len, indexer.block_size, indexer.num_chosen_blocks,
                                        indexer.num_local_blocks)
        allowed = allowed.repeat_interleave(cfg.num_heads // cfg.num_kv_heads, dim=0)  # [H, n, L]
        return chosen_attention(q, keys[self.kv_heads], values, allowed, self.scale)


class MiniMaxM3ForCausalLM(LlamaForCausalLM):
    splits_across_ranks = True
    # MiniMax's names as released (MiniMaxM3SparseForConditionalGeneration) against transformers': its experts' as
    # Mixtral's (w1, w3, w2), its shared experts' and dense MLPs' gate and up apart.
    renames = (("block_sparse_moe.", "mlp."), *((f"self_attn.index_{x}.", f"self_attn.indexer.{x}.")
                                                for x in INDEXER_WEIGHTS))

    def sum_across_ranks(self, rank_sum: RankSum, num_ranks: int, rank: int, vocab_size: int | None) -> None:
        """Also each attention's place among the pages' heads: its share of the KV heads, the indexer's key after
        every rank's (written alike by each, from the indexer's whole key projection)."""
        super().sum_across_ranks(rank_sum, num_ranks, rank, vocab_size)
        for layer in self.layers:
            layer.attn.place(rank, num_ranks)

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        attention = BlockSparseAttention if layer in self.config.minimax_m3.sparse_layers else FullAttention
        made = DecoderLayer(self.config, self.kernels, dtype, None, self._is_sparse(layer), attention=attention)
        if not self._is_sparse(layer):
            made.mlp = ClampedGluMLP(self.config, self.kernels, dtype)
        return made

    def _attention_names(self, layer: int) -> list[str]:
        names = super()._attention_names(layer)
        if layer in self.config.minimax_m3.sparse_layers:
            names += [f"model.layers.{layer}.self_attn.indexer.{x}.weight" for x in INDEXER_WEIGHTS]
        return names

    def _mlp_names(self, layer: int) -> list[str]:
        p = f"model.layers.{layer}.mlp."
        if self.config.multimodal is not None:  # as released
            if not self._is_sparse(layer):
                return super()._mlp_names(layer)
            return [p + "gate.weight", p + "e_score_correction_bias"] + [
                p + f"experts.{e}.{w}.weight" for e in range(self.config.moe.num_experts) for w in ("w1", "w2", "w3")
            ] + [p + f"shared_experts.{x}_proj.weight" for x in ("gate", "up", "down")]
        if not self._is_sparse(layer):
            return [p + "gate_up_proj.weight", p + "down_proj.weight"]
        return [p + "gate.weight", p + "gate.e_score_correction_bias", p + "experts.gate_up_proj",
                p + "experts.down_proj", p + "shared_experts.gate_up_proj.weight",
                p + "shared_experts.down_proj.weight"]

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((name, tensor.float() + 1.0 if name.endswith("norm.weight") else tensor)
                             for name, tensor in tensors)

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".")
        if len(parts) > 5 and parts[3:5] == ["self_attn", "indexer"]:
            return getattr(self.layers[int(parts[2])].attn, INDEXER_WEIGHTS[parts[5]]).data
        if len(parts) > 4 and parts[3:5] == ["mlp", "gate_up_proj"]:
            return self.layers[int(parts[2])].mlp.gate_up_weight.data
        return super()._target(name)

