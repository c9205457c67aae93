"""Block-sparse attention, in torch: which tokens each query attends to, and attention over a sequence's pages under
that choice. Qwen4-Exp's (engine/qwen4_exp_config.py, `block_choice`) and MiniMax-M3's (engine/minimax_m3_config.py,
`best_key_block_choice`).

Qwen4-Exp's: a query at position p sees (p + 1) // block_size complete blocks before it. Where they are more than it
may choose, it chooses the best by score (its indexer heads' ReLU'd dot products with a block's key, summed, over the
square root of the width), computed and ranked as transformers does, query by query, so that ties fall alike: the
queries of a chunk seeing as many blocks are ranked together, a row each. It attends to its chosen blocks' tokens and
to every token from the end of its last complete block to itself.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def block_choice(queries: torch.Tensor, block_keys: torch.Tensor, first_position: int, block_size: int,
                 num_chosen: int) -> torch.Tensor:
    """queries [n, Hi, D] of positions first_position, ..., first_position + n - 1; block_keys [B, D], B at least
    the complete blocks the last query sees → [n, first_position + n] bool: the tokens each query attends to."""
    n = queries.shape[0]
    total = first_position + n
    positions = torch.arange(first_position, total, device=queries.device)
    seen = (positions + 1) // block_size  # complete blocks each query sees
    key_positions = torch.arange(total, device=queries.device)
    allowed = (key_positions >= (seen * block_size).unsqueeze(1)) & (key_positions <= positions.unsqueeze(1))
    seen_list = seen.tolist()
    row = 0
    while row < n:
        num_blocks = seen_list[row]
        end = row + seen_list.count(num_blocks)  # the queries seeing as many blocks: consecutive
        if num_blocks:
            covered = num_blocks * block_size
            if num_blocks <= num_chosen:
                allowed[row:end, :covered] = True
            else:
                scores = torch.matmul(queries[row:end].float(), block_keys[:num_blocks].float().t())  # [g, Hi, B]
                scores = torch.relu(scores.transpose(-1, -2)).sum(dim=-1) / math.sqrt(queries.shape[-1])
                best = scores.topk(num_chosen, dim=-1).indices
                chosen = torch.zeros(end - row, num_blocks, dtype=torch.bool, device=queries.device)
                allowed[row:end, :covered] = chosen.scatter_(1, best, True).repeat_interleave(block_size, dim=1)
        row = end
    return allowed


def best_key_block_choice(scores: torch.Tensor, first_position: int, block_size: int, num_chosen: int,
                          num_local: int) -> torch.Tensor:
    """MiniMax-M3's: `scores` [Hi, n, L] of each indexer head for each of n queries (positions first_position, ...)
    against each key → [Hi, n, L] bool, the keys each head's group of each query attends to: those of the
    `num_chosen` blocks whose best earlier key scores best, the `num_local` blocks ending at the query's own always
    among them, none after the query."""
    num_heads, n, total = scores.shape
    positions = torch.arange(first_position, first_position + n, device=scores.device)
    future = torch.arange(total, device=scores.device).unsqueeze(0) > positions.unsqueeze(1)  # [n, L]
    num_blocks = -(-total // block_size)
    padded = F.pad(scores.masked_fill(future, float("-inf")), (0, num_blocks * block_size - total),
                   value=float("-inf"))
    block_scores = padded.view(num_heads, n, num_blocks, block_size).amax(dim=-1)  # [Hi, n, B]
    own = positions // block_size
    for back in range(num_local):
        block_scores[:, torch.arange(n), (own - back).clamp(min=0)] = float("inf")
    best_scores, best = block_scores.topk(min(num_chosen, num_blocks), dim=-1)
    best = best.masked_fill(best_scores == float("-inf"), num_blocks)  # a future block: nothing
    chosen = torch.zeros(num_heads, n, num_blocks + 1, dtype=torch.bool, device=scores.device)
    chosen = chosen.scatter_(-1, best, True)[..., :num_blocks]
    return chosen.repeat_interleave(block_size, dim=-1)[..., :total] & ~future


def pooled_block_keys(keys: torch.Tensor, block_size: int) -> torch.Tensor:
    """The mean of each complete block's keys [L, D] → [L // block_size, D], taken in float32."""
    num_blocks = keys.shape[0] // block_size
    blocks = keys[:num_blocks * block_size].float().view(num_blocks, block_size, keys.shape[-1])
    return blocks.mean(dim=1).to(keys.dtype)


def gathered_pages(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of a sequence's pages `blocks` of `cache` [H, N, bs, D]: [H, length, D]."""
    pages = cache.index_select(1, blocks)
    return pages.view(pages.shape[0], -1, pages.shape[-1])[:, :length]


def chosen_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [n, Hq, D] against keys and values [Hkv, L, D] where `allowed` ([n, L], or [Hq, n, L] a head) → [n, Hq, D]."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                         attn_mask=allowed, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
