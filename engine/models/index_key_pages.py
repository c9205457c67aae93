"""What the block-sparse attentions (Qwen4-Exp's, engine/models/qwen4_exp.py; MiniMax-M3's, engine/models/minimax_m3.py)
share: their indexer's key of each token kept in the pages as one more KV head (ModelConfig.page_kv_heads), and each
sequence of a step attending over its own pages in turn."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.attention_metadata import AttentionMetadata
from engine.models.llama_layers import KVCache
from kernels.registry import Kernels


def write_with_index_keys(ops: Kernels, k: torch.Tensor, v: torch.Tensor, index_k: torch.Tensor, kv_cache: KVCache,
                          meta: AttentionMetadata, kv_heads: slice | None = None,
                          index_head: int | None = None) -> None:
    """k, v [T, Hkv, D] and the indexer's keys [T, Di] into the step's slots: the pages' last head holds the key
    (zero-padded to D) where k's would be, and no v. `kv_heads`, `index_head`: where they lie in the pages, where
    those are not theirs alone (a rank's share of a split model's heads, engine/models/minimax_m3.py)."""
    num_tokens, head_dim = k.shape[0], k.shape[-1]
    page_k = torch.cat((k, F.pad(index_k, (0, head_dim - index_k.shape[-1])).unsqueeze(1)), dim=1)
    page_v = torch.cat((v, v.new_zeros(num_tokens, 1, head_dim)), dim=1)
    if kv_heads is None or kv_heads == slice(0, index_head):  # the pages' heads all its own
        ops.write_kv(page_k, page_v, *kv_cache, meta.slot_mapping)
        return
    ops.write_kv(k, v, kv_cache[0][kv_heads], kv_cache[1][kv_heads], meta.slot_mapping)
    index = slice(index_head, index_head + 1)
    ops.write_kv(page_k[:, -1:], page_v[:, -1:], kv_cache[0][index], kv_cache[1][index], meta.slot_mapping)


# attend(q rows, index q rows, the sequence's block table, its tokens before these) → the rows' attention output
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def by_sequence(q: torch.Tensor, index_q: torch.Tensor, meta: AttentionMetadata, attend: Attend) -> torch.Tensor:
    """The step's attention [T, H, D], a decode row, then a prefill chunk, at a time (each its own number of blocks
    to rank, as transformers ranks them query by query)."""
    out = torch.empty_like(q)
    for row in range(meta.num_decode_tokens):
        out[row:row + 1] = attend(q[row:row + 1], index_q[row:row + 1], meta.decode_block_tables[row],
                                  int(meta.decode_context_lens[row]) - 1)
    for chunk in meta.prefills:
        s, e = chunk.start, chunk.end
        out[s:e] = attend(q[s:e], index_q[s:e], chunk.block_table, chunk.context_len)
    return out
