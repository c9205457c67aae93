"""Attention over paged KV: prefill (one sequence's chunk) and decode (a batch).

Both read keys and values from pages laid out `[Hkv, N, bs, D]` (see kv_cache.py), in q's dtype
whatever the pages hold (an fp8 cache is cast up as it is read),
and handle grouped-query attention, causal masking with a cached prefix, an
optional sliding window (Mistral) or attention within fixed chunks of positions (Llama 4's
chunked layers: a token attends to the earlier tokens of its own chunk), optional logit
soft-capping (Gemma 2), optional attention sinks (gpt-oss: a learnt logit per q head that
takes its share of the softmax and attends to nothing), and optional ALiBi (BLOOM: each q head's
scores plus its slope times the key's position, as transformers adds it; under the softmax, the same
as the distance back from the query). A head wider than the pages' (Gemma 4's full
layers') spans `head_parts` of their heads, side by side: page heads 2h and 2h + 1 hold head h's halves.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def prefill_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    chunk_size: int | None = None,
    sinks: torch.Tensor | None = None,
    bidirectional: tuple[tuple[int, int], ...] = (),
    head_parts: int = 1,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence's chunk of `n` new tokens after `context_len` cached ones. `sinks`, `alibi_slopes`: [Hq].
    `bidirectional`: spans of positions [start, end) whose tokens attend to each other whatever their
    order (an image's, in Gemma 3), within any sliding window; the chunk holds each one's end.

    q: [n, Hq, D]; k, v: [n, Hkv, D] (already written to the pages), or None where the chunk's keys and
    values are another layer's, read from its pages; k_cache, v_cache: [Hkv * head_parts, N, bs, D / head_parts];
    block_table: [num_blocks_of_seq] int64. Returns [n, Hq, D].
    """
    n = q.shape[0]
    num_kv_heads, block_size = k_cache.shape[0] // head_parts, k_cache.shape[2]
    total = context_len + n
    # A leading batch dim of 1: 4-D inputs take torch's fused CPU kernel, 3-D
    # ones a path several times slower.
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    if (k is not None and context_len == 0 and (sliding_window is None or n <= sliding_window) and softcap is None
            and (chunk_size is None or n <= chunk_size) and sinks is None and not bidirectional
            and alibi_slopes is None):
        out = F.scaled_dot_product_attention(
            qh, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
            is_causal=True, scale=scale, enable_gqa=True,
        )
        return out[0].transpose(0, 1)
    num_blocks = (total + block_size - 1) // block_size
    blocks = block_table[:num_blocks]
    keys = _gathered(k_cache, blocks, head_parts)[:, :total].to(q.dtype)
    values = _gathered(v_cache, blocks, head_parts)[:, :total].to(q.dtype)
    q_pos = torch.arange(context_len, total, device=q.device).unsqueeze(1)  # [n, 1]
    k_pos = torch.arange(total, device=q.device).unsqueeze(0)  # [1, total]
    mask = k_pos <= q_pos
    for start, end in bidirectional:
        mask |= (q_pos >= start) & (q_pos < end) & (k_pos >= start) & (k_pos < end)
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    if chunk_size is not None:
        mask &= k_pos // chunk_size == q_pos // chunk_size
    if softcap is not None or sinks is not None or alibi_slopes is not None:
        # [Hkv, g, n, D] against [Hkv, 1, total, D]: each kv head's q heads
        sink_logits = None if sinks is None else sinks.view(num_kv_heads, -1, 1, 1)
        bias = None if alibi_slopes is None else alibi_slopes.view(num_kv_heads, -1, 1, 1) * k_pos
        out = written_out_attention(qh[0].unflatten(0, (num_kv_heads, -1)), keys.unsqueeze(1), values.unsqueeze(1),
                                    mask, scale, softcap, sink_logits, bias)
        return out.flatten(0, 1).transpose(0, 1)
    out = F.scaled_dot_product_attention(
        qh, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    chunk_size: int | None = None,
    sinks: torch.Tensor | None = None,
    head_parts: int = 1,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per sequence over its pages. `sinks`, `alibi_slopes`: [Hq].

    q: [B, Hq, D]; k_cache, v_cache: [Hkv * head_parts, N, bs, D / head_parts]; block_tables: [B, max_blocks]
    int64 (padding may be any valid block id: it is masked); context_lens: [B] int64, counting the new token.
    Returns [B, Hq, D].
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[0] // head_parts, k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = block_tables.shape[1] * block_size
    flat = block_tables.reshape(-1)
    keys = _gathered(k_cache, flat, head_parts).view(num_kv_heads, batch, max_len, head_dim).to(q.dtype)
    values = _gathered(v_cache, flat, head_parts).view(num_kv_heads, batch, max_len, head_dim).to(q.dtype)
    # Heads lead, so each (kv head, sequence) slice is contiguous and no K/V copy is needed.
    qh = q.view(batch, num_kv_heads, group, head_dim).transpose(0, 1)  # [Hkv, B, g, D]
    k_pos = torch.arange(max_len, device=q.device).unsqueeze(0)  # [1, L]
    mask = k_pos < context_lens.unsqueeze(1)  # [B, L]
    if sliding_window is not None:
        mask &= k_pos >= (context_lens - sliding_window).unsqueeze(1)
    if chunk_size is not None:  # from the first position of the chunk the new token is in
        mask &= k_pos >= ((context_lens - 1) // chunk_size * chunk_size).unsqueeze(1)
    if softcap is not None or sinks is not None or alibi_slopes is not None:
        sink_logits = None if sinks is None else sinks.view(num_kv_heads, 1, group, 1)
        bias = None if alibi_slopes is None else alibi_slopes.view(num_kv_heads, 1, group, 1) * k_pos
        out = written_out_attention(qh, keys, values, mask[None, :, None, :], scale, softcap, sink_logits, bias)
    else:
        out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask[None, :, None, :], scale=scale)
    # Contiguous, as callers view it: CUDA's fused kernels lay their output out by query position.
    return out.transpose(0, 1).reshape(batch, num_heads, head_dim).contiguous()


def _gathered(cache: torch.Tensor, blocks: torch.Tensor, head_parts: int) -> torch.Tensor:
    """The pages `blocks` of `cache` [H * head_parts, N, bs, d], in turn: [H, len(blocks) * bs, d * head_parts]."""
    pages = cache.index_select(1, blocks)
    if head_parts == 1:
        return pages.view(pages.shape[0], -1, pages.shape[-1])
    parts = pages.view(pages.shape[0] // head_parts, head_parts, -1, pages.shape[-1])
    return parts.transpose(1, 2).reshape(parts.shape[0], parts.shape[2], -1)


def written_out_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                          scale: float, softcap: float | None, sink_logits: torch.Tensor | None,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    # What no fused SDPA kernel does, written out as transformers' eager attention computes it (softmax
    # in float32): Gemma 2's scores pass through softcap * tanh(score / softcap) before the mask;
    # gpt-oss's sink logit joins each row's softmax as one more column, which attends to nothing; ALiBi's `bias`
    # is added to the scores.
    scores = (q @ keys.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sink_logits is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ values
    with_sinks = torch.cat((scores, sink_logits.to(scores.dtype).expand(*scores.shape[:-1], 1)), dim=-1)
    return torch.softmax(with_sinks, dim=-1, dtype=torch.float32)[..., :-1].to(q.dtype) @ values
