"""Multi-head latent attention over pages that hold the latent, not per-head keys and values.

A token's cache row is `[k_rope, latent]` (`rope + rank` wide): the RoPE part of k every head shares,
and the normed latent that each head's k (nope part) and v are projected up from (DeepSeek-V3.2's adds its
indexer's key after them: `sparse_selection` reads it). A layer's pages
are `[1, N, bs, W]` twice (kv_cache.py's layout, one kv head): the row's first W dimensions go in
the k pages, the rest in the v pages (padded to 2W), so the row costs what MLA's cache should, and
the pool, transfers and prefix cache move it as any other model's KV.

Decode attends in the latent space (the up-projection of k absorbed into q, of v applied after),
one row of keys for every head; a prefill chunk projects its context's rows up to each head's k and
v and attends as ordinary attention does: fewer multiplications where many tokens ask at once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention import written_out_attention
from kernels.kv_cache import write_kv_torch


def write_latent_rows(rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """rows: [T, R] (R ≤ 2W); k_cache, v_cache: [1, N, bs, W]; slot_mapping: [T] int64."""
    width = k_cache.shape[-1]
    halves = F.pad(rows, (0, 2 * width - rows.shape[-1])).view(rows.shape[0], 1, 2 * width)
    write_kv_torch(halves[..., :width], halves[..., width:], k_cache, v_cache, slot_mapping)


def read_latent_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                     row_width: int, dtype: torch.dtype) -> torch.Tensor:
    """The rows of pages `blocks` ([...] int64) in order, in `dtype` (fp8 pages cast up):
    [..., len(last dim) * bs, row_width]."""
    _, _, block_size, width = k_cache.shape
    shape = (*blocks.shape[:-1], blocks.shape[-1] * block_size, width)
    flat = blocks.reshape(-1)
    k_half = k_cache[0].index_select(0, flat).view(shape)
    v_half = v_cache[0].index_select(0, flat).view(shape)
    return torch.cat((k_half, v_half), dim=-1)[..., :row_width].to(dtype)


def mla_decode_attention_torch(q_rope: torch.Tensor, q_latent: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """One new token per sequence, in the latent space: q_rope [B, H, rope] and q_latent [B, H, rank]
    (q's nope part through each head's k up-projection) against the rows `[k_rope, latent]`, the
    latent also the values. block_tables: [B, max_blocks] int64 (padding masked); context_lens: [B],
    counting the new token. Returns [B, H, rank]: each head's attended latent."""
    rows = read_latent_rows(k_cache, v_cache, block_tables, q_rope.shape[-1] + q_latent.shape[-1], q_rope.dtype)
    k_pos = torch.arange(rows.shape[1], device=rows.device).unsqueeze(0)  # [1, L]
    return latent_decode_attention(q_rope, q_latent, rows, k_pos < context_lens.unsqueeze(1), scale)


def latent_decode_attention(q_rope: torch.Tensor, q_latent: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor,
                            scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`mla_decode_attention_torch` over each sequence's rows read already ([B, L, >= rope + rank]), each query
    attending to the rows `allowed` says ([B, L] bool: its context, or the tokens DSA chose in it). `sinks` [H]: a
    learnt logit a head that takes its share of the softmax and attends to nothing (Hy4's)."""
    rope, rank = q_rope.shape[-1], q_latent.shape[-1]
    rows = rows[..., :rope + rank]
    # Every head reads the same row: the heads stand as one sequence's queries against it.
    q = torch.cat((q_rope, q_latent), dim=-1).unsqueeze(1)  # [B, 1, H, R]
    keys, values, mask = rows.unsqueeze(1), rows[..., rope:].unsqueeze(1), allowed[:, None, None, :]
    if sinks is not None:
        return written_out_attention(q, keys, values, mask, scale, None, sinks.view(1, 1, -1, 1)).squeeze(1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale).squeeze(1)


def causal_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int,
                           scale: float, allowed: torch.Tensor | None = None, sinks: torch.Tensor | None = None
                           ) -> torch.Tensor:
    """n new tokens after `context_len` others: q [n, H, Dqk], k [context_len + n, H, Dqk],
    v [context_len + n, H, Dv] → [n, H, Dv]. `allowed` ([n, context_len + n] bool): the keys each query may
    attend to within its causal context (DSA's choice); None: all of them. `sinks` [H]: as latent_decode_attention's."""
    total = k.shape[0]
    # A leading batch dim of 1: 4-D inputs take torch's fused CPU kernel.
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if context_len == 0 and allowed is None and sinks is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        q_pos = torch.arange(context_len, total, device=q.device).unsqueeze(1)  # [n, 1]
        mask = torch.arange(total, device=q.device).unsqueeze(0) <= q_pos  # [n, total]
        mask = mask if allowed is None else mask & allowed
        if sinks is None:
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
        else:
            out = written_out_attention(qh, kh, vh, mask, scale, None, sinks.view(1, -1, 1, 1))
    return out[0].transpose(0, 1)


def sparse_selection(queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                     topk: int, scale: float) -> torch.Tensor:
    """DeepSeek-V3.2's indexer's choice (DSA): each query's `topk` best keys among those `visible` to it, a key
    scored by the query's heads' ReLU'd dot products with it, weighed by `weights` and summed. queries [..., n, Hi,
    D], weights [..., n, Hi], keys [..., T, D], visible [..., n, T] bool → [..., n, T] bool (chosen and visible)."""
    scores = torch.relu(torch.einsum("...nhd,...td->...nht", queries.float(), keys.float()) * scale)
    index = torch.einsum("...nh,...nht->...nt", weights.float(), scores).masked_fill(~visible, float("-inf"))
    chosen = index.topk(min(topk, index.shape[-1]), dim=-1).indices
    return torch.zeros_like(visible).scatter_(-1, chosen, True) & visible
