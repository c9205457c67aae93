"""Qwen4-Exp (Qwen4ExpForCausalLM): Qwen3.5's Gated DeltaNet and gated attention layers (engine/models/qwen3_next.py),
each followed by experts, with hyper-connections for a residual, block-indexed attention and per-layer n-gram
embeddings (engine/qwen4_exp_config.py, kernels/block_sparse_attention.py, engine/models/ngram_embedding.py).

Its norms scale by 1 + weight, as Qwen3.5's; the hyper-connections' and the indexer's keep that sum in float32, as
transformers computes it, whatever the weights' dtype.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_metadata import AttentionMetadata
from engine.model_config import ModelConfig
from engine.models.index_key_pages import by_sequence, write_with_index_keys
from engine.models.llama_layers import KVCache
from engine.models.moe import SparseMoE
from engine.models.ngram_embedding import BUFFERS as NGRAM_BUFFERS, PerLayerNGrams
from engine.models.parameters import empty_param
from engine.models.qwen3_next import GatedAttention, GatedDeltaNet, Qwen3NextForCausalLM
from engine.prompt_embeds import GivenEmbeddings
from engine.qwen4_exp_config import BlockIndexer
from kernels.block_sparse_attention import block_choice, chosen_attention, gathered_pages, pooled_block_keys
from kernels.registry import Kernels
from kernels.rms_norm import rms_norm_scaled_in_float32 as normed

# Norms stored as offsets from 1 that Qwen3.5 has not (its own are qwen3_next.OFFSET_NORMS).
OFFSET_NORMS = ("hc_norm.weight", "indexer.q_layernorm.weight", "indexer.k_layernorm.weight", "ple.norm_key.weight",
                "ple.norm_query.weight", "ple.norm_conv.weight")
MIXES = {"attn_hyper_connection": "attn_mix", "mlp_hyper_connection": "mlp_mix"}
MIX_WEIGHTS = {"hc_norm": "norm", "input_mix_weight_down": "down", "input_mix_weight_up": "up",
               "block_inject_weight": "inject"}
INDEXER_WEIGHTS = {"index_qk_proj": "index_weight", "q_layernorm": "index_q_norm", "k_layernorm": "index_k_norm"}

RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos and sin by position


class HyperConnection(nn.Module):
    """Mixes the residual's streams [T, n * H] into a block's input [T, H] by weights of each token's own, and where
    it `injects`, each stream's weight for the block's output."""

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, injects: bool) -> None:
        super().__init__()
        self.linear, self.eps = kernels.linear, config.rms_norm_eps
        self.num_streams, self.hidden_size = config.qwen4_exp.num_streams, config.hidden_size
        width, rank = self.num_streams * config.hidden_size, config.qwen4_exp.mixer_rank
        self.norm = empty_param(width, dtype=torch.float32)
        self.down = empty_param(rank, width, dtype=dtype)
        self.up = empty_param(width, rank, dtype=dtype)
        self.inject = empty_param(self.num_streams, width, dtype=dtype) if injects else None

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = normed(streams.unflatten(-1, (self.num_streams, self.hidden_size)), self.norm.view(self.num_streams, -1),
                   self.eps).flatten(-2)
        weights = torch.sigmoid(self.linear(F.silu(self.linear(x, self.down) / self.num_streams), self.up))
        mixed = (weights.unflatten(-1, (self.num_streams, -1)) * x.unflatten(-1, (self.num_streams, -1))).mean(dim=-2)
        if self.inject is None:
            return mixed, None
        return mixed, 2 * torch.sigmoid(self.linear(x, self.inject) / self.num_streams)


def injected(streams: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A block's output [T, H] added into each stream of `streams` [T, n * H] by its weight [T, n]."""
    return streams + (out.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)


class IndexedAttention(GatedAttention):
    """Qwen3.5's gated attention, each query over the tokens its block indexer chooses."""

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, indexer: BlockIndexer) -> None:
        super().__init__(config, kernels, dtype, None)
        self.indexer = indexer
        self.index_weight = empty_param((indexer.num_heads + 1) * indexer.head_dim, config.hidden_size, dtype=dtype)
        self.index_q_norm = empty_param(indexer.head_dim, dtype=torch.float32)
        self.index_k_norm = empty_param(indexer.head_dim, dtype=torch.float32)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, tables: RopeTables) -> torch.Tensor:
        cfg, ops, num_tokens, indexer = self.config, self.kernels, x.shape[0], self.indexer
        q_gate, k, v = ops.linear(x, self.qkv_weight).split([2 * cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q, gate = q_gate.view(num_tokens, cfg.num_heads, 2 * cfg.head_dim).chunk(2, dim=-1)
        q = ops.rms_norm(q.contiguous(), self.q_norm, cfg.rms_norm_eps)
        k = ops.rms_norm(k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim), self.k_norm, cfg.rms_norm_eps)
        q, k = ops.apply_rope(q, k, cos, sin)
        index_q, index_k = ops.linear(x, self.index_weight).split(
            [indexer.num_heads * indexer.head_dim, indexer.head_dim], dim=-1)
        index_q = normed(index_q.view(num_tokens, indexer.num_heads, indexer.head_dim), self.index_q_norm,
                         cfg.rms_norm_eps)
        index_q = ops.apply_rope(index_q, index_q[:, :0], cos, sin)[0]
        # (the indexer's key kept unturned, as transformers keeps it)
        write_with_index_keys(ops, k, v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim), index_k, kv_cache, meta)
        out = by_sequence(q, index_q, meta, lambda rows, index_rows, blocks, context_len: self._attend(
            rows, index_rows, kv_cache, blocks, context_len, tables))
        gated = out.reshape(num_tokens, cfg.q_size) * torch.sigmoid(gate.reshape(num_tokens, cfg.q_size))
        return self._output(gated)

    def _attend(self, q: torch.Tensor, index_q: torch.Tensor, kv_cache: KVCache, block_table: torch.Tensor,
                context_len: int, tables: RopeTables) -> torch.Tensor:
        """One sequence's n new tokens after `context_len` others, over the tokens they choose: q [n, H, D],
        index_q [n, Hi, Di] → [n, H, D]."""
        cfg, indexer, k_cache = self.config, self.indexer, kv_cache[0]
        total = context_len + q.shape[0]
        blocks = block_table[:math.ceil(total / k_cache.shape[2])]
        keys = gathered_pages(k_cache, blocks, total).to(q.dtype)
        values = gathered_pages(kv_cache[1], blocks, total)[:cfg.num_kv_heads].to(q.dtype)
        num_blocks = total // indexer.block_size
        if num_blocks <= indexer.num_chosen_blocks:  # every query may choose every block it sees
            positions = torch.arange(total, device=q.device)
            allowed = positions.unsqueeze(0) <= positions[context_len:].unsqueeze(1)
        else:
            block_keys = normed(pooled_block_keys(keys[cfg.num_kv_heads, :, :indexer.head_dim], indexer.block_size),
                                self.index_k_norm, cfg.rms_norm_eps)
            starts = torch.arange(num_blocks, device=q.device) * indexer.block_size
            one_head = block_keys.unsqueeze(1)
            block_keys = self.kernels.apply_rope(one_head, one_head[:, :0], tables[0][starts], tables[1][starts])[0]
            block_keys = block_keys.squeeze(1)
            allowed = block_choice(index_q, block_keys, context_len, indexer.block_size, indexer.num_chosen_blocks)
        return chosen_attention(q, keys[:cfg.num_kv_heads], values, allowed, self.scale)


class Qwen4ExpDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, layer: int) -> None:
        super().__init__()
        linear_layers = config.linear_attention.linear_layers
        self.is_linear = layer in linear_layers
        self.attn = GatedDeltaNet(config, kernels, dtype, linear_layers.index(layer)) if self.is_linear else \
            IndexedAttention(config, kernels, dtype, config.qwen4_exp.indexer)
        self.mlp = SparseMoE(config, kernels, dtype)
        self.attn_mix = HyperConnection(config, kernels, dtype, injects=True)
        self.mlp_mix = HyperConnection(config, kernels, dtype, injects=True)
        ngrams = config.qwen4_exp.ngrams
        self.ngrams = PerLayerNGrams(config, kernels, dtype, ngrams.layers.index(layer)) \
            if ngrams is not None and layer in ngrams.layers else None

    def forward(self, streams: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache | None,
                meta: AttentionMetadata, tables: RopeTables, input_ids: torch.Tensor) -> torch.Tensor:
        if self.ngrams is not None:
            streams = streams + self.ngrams(streams, input_ids, meta)
        x, weights = self.attn_mix(streams)
        out = self.attn(x, meta) if self.is_linear else self.attn(x, cos, sin, kv_cache, meta, tables)
        streams = injected(streams, out, weights)
        x, weights = self.mlp_mix(streams)
        return injected(streams, self.mlp(x), weights)


class Qwen4ExpForCausalLM(Qwen3NextForCausalLM):
    serves_loras = False  # (its hyper-connections and indexed attention not yet checked with adapters)

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__(config, kernels, dtype, max_positions)
        self.norm = None  # the last mix of the streams ends it
        self.mixer = HyperConnection(config, kernels, dtype, injects=False)

    def _make_layer(self, layer: int, dtype: torch.dtype) -> nn.Module:
        return Qwen4ExpDecoderLayer(self.config, self.kernels, dtype, layer)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache], given: GivenEmbeddings | None = None) -> torch.Tensor:
        h = self._embed(input_ids)
        if given is not None:
            h = given.placed(h)
        streams = h.repeat(1, self.config.qwen4_exp.num_streams)
        places, tables = self.config.kv_places, (self.rope_cos, self.rope_sin)
        for i, (layer, (cos, sin)) in enumerate(zip(self.layers, self._ropes(positions))):
            streams = layer(streams, cos, sin, kv_caches[places[i]] if i in places else None, meta, tables, input_ids)
        return self.mixer(streams)[0]

    def checkpoint_names(self) -> list[str]:
        names = [name for name in super().checkpoint_names() if name != "model.norm.weight"]
        names += [f"model.hyper_connection_mixer.{x}.weight" for x in MIX_WEIGHTS if x != "block_inject_weight"]
        for i, layer in enumerate(self.layers):
            names += [f"model.layers.{i}.{mix}.{x}.weight" for mix in MIXES for x in MIX_WEIGHTS if x != "hc_norm"]
            if layer.ngrams is not None:
                names += layer.ngrams.checkpoint_names(f"model.layers.{i}.ple.")
        return names

    def is_unused_tensor(self, name: str) -> bool:
        # What transformers keeps beside the n-gram tables (their multipliers, sizes, offsets), made from the config.
        return name.endswith(NGRAM_BUFFERS) or super().is_unused_tensor(name)

    def _norm_names(self) -> tuple[str, ...]:
        return tuple(f"{mix}.hc_norm" for mix in MIXES)

    def _attention_names(self, layer: int) -> list[str]:
        names = super()._attention_names(layer)
        if layer in self.config.linear_attention.linear_layers:
            return names
        return names + [f"model.layers.{layer}.self_attn.indexer.{x}.weight" for x in INDEXER_WEIGHTS]

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((name, tensor.float() + 1.0 if name.endswith(OFFSET_NORMS) else tensor)
                             for name, tensor in tensors)

    def _placed(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if name.endswith(".ple.conv1d.weight"):  # [C, 1, K]
            tensor = tensor.squeeze(1)
        return super()._placed(name, tensor)

    def _target(self, name: str) -> torch.Tensor:
        parts = name.split(".")
        if parts[1] == "hyper_connection_mixer":
            return getattr(self.mixer, MIX_WEIGHTS[parts[2]]).data
        if len(parts) > 4 and parts[3] in MIXES:
            return getattr(getattr(self.layers[int(parts[2])], MIXES[parts[3]]), MIX_WEIGHTS[parts[4]]).data
        if len(parts) > 4 and parts[3] == "ple":
            return self.layers[int(parts[2])].ngrams.target(".".join(parts[4:]))
        if len(parts) > 5 and parts[3:5] == ["self_attn", "indexer"]:
            return getattr(self.layers[int(parts[2])].attn, INDEXER_WEIGHTS[parts[5]]).data
        return super()._target(name)
