"""Writing new K/V into pages.

Page layout per layer (head-major, so a gather of a sequence's pages is one
copy that attention reads contiguously): `[num_kv_heads, num_blocks, block_size, head_dim]`.
A token's slot is `block_id * block_size + offset`.
"""
from __future__ import annotations

import torch


def write_kv_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    # k, v: [T, Hkv, D]; k_cache, v_cache: [Hkv, N, bs, D]; slot_mapping: [T] int64
    num_kv_heads, _, _, head_dim = k_cache.shape
    if k_cache.dtype != k.dtype:  # an fp8 cache: cast, then copied as bytes (torch has no fp8 index_copy_)
        k, v = k.to(k_cache.dtype).view(torch.uint8), v.to(v_cache.dtype).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, v.transpose(0, 1))
